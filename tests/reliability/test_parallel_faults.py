"""Faults around `parallelize` (issue 25): tensor-parallel ranks that built different weights train one model (the
first rank's), and a save by rank 0 alone of a model that is not split involves no other rank.

The checks run their own bodies under torchrun (2 ranks, gloo, a short collective timeout so that a hang fails
fast) and fail at their own assert."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def launch(body: str, *args: str) -> None:
    from helpers import torchrun_script  # here: this file is also the ranks' script, run without tests/ on the path

    torchrun_script(__file__, body, *args)


def test_ranks_with_different_weights_train_the_first_ranks_model_and_a_single_rank_save_needs_no_peer(tmp_path):
    launch("parallel_faults", str(tmp_path))


# ---- the body, run under torchrun ----


def parallel_faults(folder: str):
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import tiny_gpt_config, tiny_seq2seq_config

    from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
    from hf_ppmoe.parallel import init_distributed, make_mesh, parallelize

    timeout = timedelta(seconds=60)
    init_distributed(timeout=timeout)
    rank = dist.get_rank()
    mesh = make_mesh(tp=2, timeout=timeout)

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    # 1. each rank built its model with its own seed: parallelize makes it rank 0's model
    for cls, config in (
        (GPTMoEForCausalLM, tiny_gpt_config(router_type="gshard", capacity_factor=1.0)),
        (Seq2SeqMoEForConditionalGeneration, tiny_seq2seq_config()),
    ):
        torch.manual_seed(0)
        ref = cls(config).train()  # rank 0's model, on every rank
        torch.manual_seed(rank)
        model = cls(config).train()
        assert rank == 0 or not torch.equal(model.lm_head.weight, ref.lm_head.weight)
        parallelize(model, mesh["tp"])
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            assert torch.equal(whole(p), ref_params[name]), f"{name} differs from rank 0's"
        for gate, ref_gate in zip(
            (m for n, m in model.named_modules() if n.endswith("mlp.gate")),
            (m for n, m in ref.named_modules() if n.endswith("mlp.gate")),
        ):
            ref_gate.generator = torch.Generator().manual_seed(0)
            gate.generator = torch.Generator().manual_seed(0)
        ids = torch.randint(3, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
        loss, ref_loss = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_loss.backward()
        assert torch.allclose(loss, ref_loss, atol=1e-5), (loss.item(), ref_loss.item())
        for name, p in model.named_parameters():
            grad, ref_grad = whole(p.grad), ref_params[name].grad
            assert torch.allclose(grad, ref_grad, atol=2e-6), f"{name}: gradient differs from rank 0's model's"

    # 2. a model that is not split (here built from the split one's config, which records the split) saved by rank 0
    # alone: no gather, no barrier, so no wait for a rank that never calls save_pretrained
    config = tiny_gpt_config()
    parallelize(GPTMoEForCausalLM(config), mesh["tp"])
    plain = GPTMoEForCausalLM(config)  # shares the config, on which the split model recorded its layout
    assert plain.config.distributed_config is not None
    if rank == 0:
        plain.save_pretrained(folder)
        loaded = GPTMoEForCausalLM.from_pretrained(folder)
        for (name, p), q in zip(plain.state_dict().items(), loaded.state_dict().values()):
            assert torch.equal(p, q), name
    dist.barrier()  # the other rank waits here only: had the save waited for it, rank 0 would time out above
    dist.destroy_process_group()


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
