"""megatron-core models built by `hf_ppmoe.parallel.megatron_plugin` against `GPTMoEForCausalLM`, on CPU with gloo.

    torchrun --nproc_per_node 2 megatron_checks.py RESULTS.json WORK_DIR

One launch (importing megatron-core costs ~20 s per process) runs three layouts one after the other:
    tp2  TP = EP = 2 (experts on the TP group, sequence parallel)     pp2  PP = 2     tp1  TP = 1, DP = 2
and records, per check, the largest absolute difference to the HF model; test_megatron_model.py asserts on them.
A check that raises is recorded as its error message.

Weights reach Megatron through `hf_ppmoe.conversion.megatron_checkpoint` (strict `load_state_dict`, so names and shapes must be
exactly what megatron-core builds) and come back through it (Megatron's own random init -> HF model, same logits).
Training checks run `GPTMoETrainStep` inside megatron-core's pipeline schedules and compare the gradients of every
parameter with those of HF's loss (LM + aux + z), and the reported losses with HF's.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_cpu  # noqa: E402
from helpers import GPT2_STYLE, tiny_gpt_config  # noqa: E402

# every config uses all four MoE-relevant mappings once: gates, biases, positions, norms, tying, dense/MoE mixing
CONFIGS = {
    # GQA, SwiGLU, RMSNorm, RoPE, Qwen3's per-head q/k norm (qk_layernorm), untied, top-2 renormalised, every FFN MoE,
    # aux and z losses
    "llama": dict(qk_norm=True, router_aux_loss_coef=0.02, router_z_loss_coef=0.01),
    # learned positions, LayerNorm, biases everywhere (experts too), tied embeddings, tanh GELU, Switch top-1
    "gpt2": dict(GPT2_STYLE, router_type="switch", num_experts_per_tok=1, router_z_loss_coef=0.01),
    # q/k/v bias only, top-2 without renormalisation, a dense first layer, a shared expert, sliding window
    "qwen": dict(
        attention_bias=True,
        attention_output_bias=False,
        norm_topk_prob=False,
        moe_layer_frequency=2,
        shared_expert_intermediate_size=32,
        sliding_window=4,
    ),
}
B, S = 2, 8
results: dict[str, float | str] = {}


def record(name, fn):
    try:
        results[name] = float(fn())
    except Exception:  # noqa: BLE001  (reported to pytest with the traceback)
        results[name] = traceback.format_exc(limit=6)


def config(name, **overrides):
    return tiny_gpt_config(**{**CONFIGS[name], **overrides})


def hf_model(cfg, seed=0):
    from hf_ppmoe import GPTMoEForCausalLM

    torch.manual_seed(seed)
    return GPTMoEForCausalLM(cfg)


def inputs(cfg, seed=1):
    return torch.randint(3, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))


def ranks():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()


def build(cfg, divisible_by=128):
    from megatron.core import parallel_state as ps

    from hf_ppmoe.parallel.megatron_plugin import model_provider

    provider = model_provider(cfg, make_vocab_size_divisible_by=divisible_by, use_cpu_initialization=True)
    return provider(pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())


def load(model, hf_state_dict, cfg, divisible_by=128):
    from hf_ppmoe.conversion.megatron_checkpoint import to_megatron

    tp, pp = model.config.tensor_model_parallel_size, model.config.pipeline_model_parallel_size
    shards = to_megatron(hf_state_dict, cfg, tp=tp, pp=pp, make_vocab_size_divisible_by=divisible_by)
    model.load_state_dict(shards[ranks()], strict=True)
    return model


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def logits(model, ids):
    pos = torch.arange(S).expand(B, S)
    with torch.no_grad():
        return model(ids, pos, None, runtime_gather_output=True)


def gather_state_dicts(model):
    """{(tp_rank, pp_rank): state dict} of every rank (what a Megatron-LM save would write)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ranks(), model.state_dict()))
    return dict(gathered)


def check_logits(tag, name):
    cfg = config(name)
    hf = hf_model(cfg).eval()
    ids = inputs(cfg)
    model = load(build(cfg), hf.state_dict(), cfg).eval()
    with torch.no_grad():
        expected = hf(ids).logits
    record(f"{tag}/{name}/logits", lambda: max_diff(logits(model, ids)[..., : cfg.vocab_size], expected))

    def reverse():  # Megatron's own (random) weights -> HF: same logits
        from hf_ppmoe.conversion.megatron_checkpoint import from_megatron

        torch.manual_seed(5)
        megatron_cpu.seed(5)
        fresh = build(cfg).eval()
        shards = gather_state_dicts(fresh)
        back = hf_model(cfg)
        back.load_state_dict(from_megatron(shards, cfg, tp=fresh.config.tensor_model_parallel_size, pp=1), strict=True)
        with torch.no_grad():
            return max_diff(logits(fresh, ids)[..., : cfg.vocab_size], back.eval()(ids).logits)

    record(f"{tag}/{name}/logits_from_megatron", reverse)


def check_checkpoint_file(tag, name, work_dir):
    """Megatron-LM's loader: file name from the parallel ranks, plain torch.load, strict load_state_dict."""
    from megatron.core import parallel_state as ps

    from hf_ppmoe.conversion.megatron_checkpoint import checkpoint_args, save_megatron_checkpoint, to_megatron

    cfg = config(name)
    hf = hf_model(cfg).eval()
    tp = ps.get_tensor_model_parallel_world_size()
    root = Path(work_dir) / f"{tag}-{name}"
    if dist.get_rank() == 0:
        save_megatron_checkpoint(to_megatron(hf.state_dict(), cfg, tp=tp), root, checkpoint_args(cfg, tp=tp, pp=1))
    dist.barrier()

    def run():
        tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        folder = f"mp_rank_{tp_rank:02d}" + (f"_{ep_rank:03d}" if ps.get_expert_model_parallel_world_size() > 1 else "")
        state = torch.load(root / "release" / folder / "model_optim_rng.pt", map_location="cpu")
        model = build(cfg).eval()
        model.load_state_dict(state["model"], strict=True)
        assert state["args"].padded_vocab_size == model.vocab_size and state["checkpoint_version"] == 3.0
        ids = inputs(cfg)
        with torch.no_grad():
            return max_diff(logits(model, ids)[..., : cfg.vocab_size], hf(ids).logits)

    record(f"{tag}/{name}/checkpoint_logits", run)


def run_schedule(model, cfg, batch, forward_step, forward_only):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()
    with megatron_cpu.CudaToCpuMode():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([batch]),
            model=[model],
            num_microbatches=1,
            seq_length=S,
            micro_batch_size=B,
            forward_only=forward_only,
        )


def finish_grads(model):
    """What megatron-core's finalize_model_grads does for a DDP-wrapped model: sum the gradients of parameters tagged
    `sequence_parallel` over the TP group (norms; with megatron_cpu's norm the q/k norms of qk_layernorm are tagged too,
    which finalize_model_grads sums by name), and the tied embedding's over the first and last pipeline stage."""
    from megatron.core import parallel_state as ps

    for p in model.parameters():
        if (
            p.grad is not None
            and getattr(p, "sequence_parallel", False)
            and ps.get_tensor_model_parallel_world_size() > 1
        ):
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    if model.share_embeddings_and_output_weights and ps.get_pipeline_model_parallel_world_size() > 1:
        weight = model.shared_embedding_or_output_weight()
        dist.all_reduce(weight.grad, group=ps.get_embedding_group())


def check_training(tag, name):
    """GPTMoETrainStep in megatron-core's schedule vs HF loss.backward(): every gradient and the reported losses."""
    from megatron.core import parallel_state as ps

    from hf_ppmoe.conversion.megatron_checkpoint import to_megatron
    from hf_ppmoe.parallel.megatron_plugin import GPTMoETrainStep

    cfg = config(name, vocab_size=96)  # no vocabulary padding: padded logits would join Megatron's softmax
    hf = hf_model(cfg).train()
    ids = inputs(cfg)
    out = hf(ids, labels=ids)
    out.loss.backward()
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    model = load(build(cfg, divisible_by=1), hf.state_dict(), cfg, divisible_by=1).train()
    step = GPTMoETrainStep(SimpleNamespace(model_return_dict=False), config=cfg)
    reported = run_schedule(model, cfg, {"input_ids": ids}, step.forward_step, forward_only=False)
    finish_grads(model)

    def grads():
        hf_grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in hf.named_parameters()}
        expected = to_megatron(hf_grads, cfg, tp=tp, pp=pp, make_vocab_size_divisible_by=1)[ranks()]
        params = dict(model.named_parameters())
        assert set(params) == {k for k, v in expected.items() if v is not None}, set(params) ^ set(expected)
        return max(max_diff(params[k].grad, expected[k]) for k in params)

    record(f"{tag}/{name}/grads", grads)
    if not ps.is_pipeline_last_stage():
        return
    (losses,) = reported
    lm_loss = out.loss - cfg.router_aux_loss_coef * out.aux_loss - cfg.router_z_loss_coef * out.z_loss
    record(f"{tag}/{name}/lm_loss", lambda: abs(losses["lm loss"].item() - lm_loss.item()))
    if pp == 1:
        record(
            f"{tag}/{name}/aux_loss",
            lambda: abs(losses["aux loss"].item() - cfg.router_aux_loss_coef * out.aux_loss.item()),
        )
        record(
            f"{tag}/{name}/z_loss", lambda: abs(losses["z loss"].item() - cfg.router_z_loss_coef * out.z_loss.item())
        )
        record(f"{tag}/{name}/total_loss", lambda: abs(sum(v.item() for v in losses.values()) - out.loss.item()))
    else:  # the last stage cannot see earlier stages' router losses: only the LM loss is reported
        record(f"{tag}/{name}/reports_lm_loss_only", lambda: float(set(losses) != {"lm loss"}))


def check_padded_eval(tag, name):
    """A right-padded batch through GPTMoETrainStep (evaluation): Megatron's LM loss = HF's, padding ignored."""
    from megatron.core import parallel_state as ps

    from hf_ppmoe.parallel.megatron_plugin import GPTMoETrainStep

    cfg = config(name, vocab_size=96)
    hf = hf_model(cfg).eval()
    ids = inputs(cfg)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        lg = hf(ids, attention_mask=mask).logits
    expected = F.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    model = load(build(cfg, divisible_by=1), hf.state_dict(), cfg, divisible_by=1).eval()
    step = GPTMoETrainStep(SimpleNamespace(model_return_dict=False), config=cfg)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    reported = run_schedule(model, cfg, batch, step.forward_step, forward_only=True)
    if ps.is_pipeline_last_stage():
        record(f"{tag}/{name}/padded_lm_loss", lambda: abs(reported[0]["lm loss"].item() - expected.item()))


def check_pipeline_logits(tag, name):
    """Logits out of the last stage of a forward-only pipeline schedule."""
    from megatron.core import parallel_state as ps

    cfg = config(name)
    hf = hf_model(cfg).eval()
    ids = inputs(cfg)
    model = load(build(cfg), hf.state_dict(), cfg).eval()

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)["input_ids"]
        output = model(tokens, torch.arange(S).expand(B, S), None)
        return output, lambda out: (out.sum() * 0, {"logits": out.detach()})

    reported = run_schedule(model, cfg, {"input_ids": ids}, forward_step, forward_only=True)
    if ps.is_pipeline_last_stage():
        with torch.no_grad():
            expected = hf(ids).logits
        record(f"{tag}/{name}/logits", lambda: max_diff(reported[0]["logits"][..., : cfg.vocab_size], expected))


def initialize(tp, pp):
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=tp,
        expert_tensor_parallel_size=1,
    )
    megatron_cpu.seed(1234)


def main(out_path, work_dir):
    dist.init_process_group("gloo")
    megatron_cpu.apply()
    initialize(tp=2, pp=1)
    for name in CONFIGS:
        check_logits("tp2", name)
    check_checkpoint_file("tp2", "llama", work_dir)
    check_training("tp2", "llama")
    check_training("tp2", "gpt2")
    check_padded_eval("tp2", "llama")
    initialize(tp=1, pp=2)
    check_pipeline_logits("pp2", "llama")
    check_pipeline_logits("pp2", "gpt2")
    check_training("pp2", "llama")
    check_training("pp2", "gpt2")
    initialize(tp=1, pp=1)
    for name in CONFIGS:
        check_logits("tp1", name)
    check_training("tp1", "gpt2")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        merged = {}
        for part in gathered:
            for key, value in part.items():  # the same check on several ranks: keep the worst
                keep = merged.get(key)
                merged[key] = (
                    value
                    if keep is None or isinstance(value, str) or (not isinstance(keep, str) and value > keep)
                    else keep
                )
        Path(out_path).write_text(json.dumps(merged, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
