"""Parallelism applied in the open: `print(model)` after tensor / expert parallelism shows the modules that run.

The multi-process checks run their own bodies under torchrun (2 ranks, gloo) and fail at their own assert."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def launch(body: str, *args: str) -> None:
    from helpers import torchrun_script  # here: this file is also the ranks' script, run without tests/ on the path

    torchrun_script(__file__, body, *args)


def test_repr_shows_tensor_and_expert_parallel_modules():
    launch("visible_modules")


# ---- the body, run under torchrun ----


def visible_modules():
    import torch
    import torch.distributed as dist
    from transformers import DistributedConfig

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import tiny_gpt_config, tiny_seq2seq_config

    from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
    from hf_ppmoe.moe import MoELayer
    from hf_ppmoe.moe.experts import Experts
    from hf_ppmoe.parallel import expert_mesh, init_distributed, make_mesh, parallelize
    from hf_ppmoe.parallel.modules import ExpertParallel, TensorParallel

    init_distributed()
    rank = dist.get_rank()
    mesh = make_mesh(tp=2)
    ppmoe = f"style='ppmoe', group_size=2, rank={rank}, experts=[{2 * rank}, {2 * rank + 2}) of 4"
    moe_layer = rf"\(mlp\): TensorParallelMoELayer\(\s+style='ppmoe_ffn', group_size=2, rank={rank}\n"

    for cls, config in (
        (GPTMoEForCausalLM, tiny_gpt_config(moe_layer_frequency=2)),  # layer 0 dense, layer 1 MoE
        (Seq2SeqMoEForConditionalGeneration, tiny_seq2seq_config()),
    ):
        torch.manual_seed(0)
        model = cls(config)
        keys = list(model.state_dict())
        ref = cls(config)
        ref.load_state_dict(model.state_dict())
        parallelize(model, mesh["tp"])
        text = repr(model)
        assert re.search(moe_layer, text), text
        assert ppmoe in text, text
        colwise = "in_features=32, out_features=32, bias=False, style='colwise', group_size=2"
        assert f"TensorParallelLinear({colwise}, rank={rank})" in text, text
        assert "style='rowwise'" in text and "style='replicated_input'" in text and "style='embedding_rowwise'" in text
        for name, module in model.named_modules():  # the original classes, and only the planned modules changed
            original = dict(ref.named_modules())[name]
            assert isinstance(module, type(original)), name
            assert isinstance(module, (TensorParallel, ExpertParallel)) == (type(module) is not type(original)), name
        experts = [m for m in model.modules() if isinstance(m, Experts)]
        assert all(isinstance(e, ExpertParallel) and e.num_experts == 2 for e in experts)
        assert all(isinstance(m, TensorParallel) for m in model.modules() if isinstance(m, MoELayer))
        assert list(model.state_dict()) == keys
        # what the repr shows is what runs: the same loss as the unsplit model
        ids = torch.randint(3, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
        assert torch.allclose(model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss, atol=1e-5)

    # the same through Transformers' expert-parallel entry point
    torch.manual_seed(0)
    distributed, _, manager = GPTMoEForCausalLM.prepare_distribute_model(
        DistributedConfig(tp_size=2, ep_size=2, ep_implementation="ppmoe")
    )
    model = GPTMoEForCausalLM.maybe_distribute_model(GPTMoEForCausalLM(tiny_gpt_config()), distributed, manager)
    text = repr(model)
    assert re.search(moe_layer, text) and ppmoe in text, text
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert all(isinstance(m, TensorParallel) and isinstance(m.experts, ExpertParallel) for m in layers)

    # experts over the data-parallel ranks (tp=1, ep=2): Transformers' all-to-all
    data_mesh = make_mesh(fsdp=2)
    model = parallelize(GPTMoEForCausalLM(tiny_gpt_config()), data_mesh["tp"], ep=expert_mesh(data_mesh, 2).ep)
    text = repr(model)
    all_to_all = f"style='all_to_all_with_drops', group_size=2, rank={rank}, experts=[{2 * rank}, {2 * rank + 2}) of 4"
    assert all_to_all in text, text
    assert all(isinstance(m, ExpertParallel) for m in model.modules() if isinstance(m, Experts))
    assert "TensorParallel" not in text, text  # ranks of different batches: the routers draw on their own
    # a single device: the plain classes
    assert all(type(m) is MoELayer and type(m.experts) is Experts for m in GPTMoEForCausalLM(tiny_gpt_config()).modules()
               if isinstance(m, MoELayer))
    dist.destroy_process_group()


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
