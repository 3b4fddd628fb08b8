"""`hf_ppmoe.plan(model, ...)`: the plan of a model on a cluster, and its text and JSON forms (what `hf-ppmoe plan`
prints)."""

from __future__ import annotations

from .hardware import Cluster
from .layouts import Run
from .search import Estimate, Plan, plan_layouts
from .shapes import model_spec
from .sources import model_config

GiB = 2**30


def plan(model, *, gpus: int = 8, gpu: str = "H100", gpus_per_node: int = 8, gpu_memory: float | None = None,
         network: str | None = None, efficiency: float | None = None, seq_len: int = 2048,
         micro_batch: int | None = None, global_batch: int | None = None, dtype: str = "bfloat16",
         master_weights: bool = True, grad_bytes: float | None = None, optimizer_bytes: float | None = None,
         recompute: bool | None = False, lora_rank: int = 0, experts_4bit: bool = False,
         reshard_after_forward: bool = True, **upcycle) -> Plan:
    """Per-rank memory and step time of every layout of `model` on `gpus` GPUs, ranked (docs/parallel.md).

    model: a GPTMoEConfig, a model folder or its config.json (GPT-MoE, or an architecture hf-ppmoe converts; with
        `upcycle` options, num_experts=..., a dense model as `hf-ppmoe upcycle` would make it MoE).
    gpu: "V100", "A100", "H100" or "H200" (hf_ppmoe.planning.GPUS: data-sheet numbers); gpu_memory (GB), network
        ("8x400": NICs x Gb/s per node) and efficiency override the preset's.
    seq_len, micro_batch (None: the fastest that fits), global_batch (sequences per optimizer step; None: 16 per GPU).
    dtype: what the layers compute in; master_weights: float32 weights, gradients and AdamW state under autocast (what
        `python -m hf_ppmoe.training --mixed_precision bf16` runs); False: weights in `dtype` too.
    grad_bytes / optimizer_bytes: per parameter, to override (18 bytes of state: 2 + 4 + 12).
    recompute: activation checkpointing of every layer (None: only where nothing fits without).
    lora_rank: LoRA adapters train, the base is frozen; experts_4bit: experts stored as bitsandbytes NF4.
    """
    config = model_config(model, **upcycle)
    cluster = Cluster.of(gpu, gpus, gpus_per_node, memory=None if gpu_memory is None else gpu_memory * 1e9,
                         network=network, efficiency=efficiency)
    run = Run(seq_len=seq_len, micro_batch=micro_batch, global_batch=global_batch, dtype=dtype,
              master_weights=master_weights, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes,
              recompute=recompute, lora_rank=lora_rank, experts_4bit=experts_4bit,
              reshard_after_forward=reshard_after_forward)
    return plan_layouts(model_spec(config), cluster, run)


def _gib(x: float) -> str:
    return f"{x / GiB:,.1f}"


def describe(result: Plan) -> list[str]:
    spec, run, c = result.spec, result.run, result.spec.config
    moe = spec.moe_layers
    shape = (f"{len(moe)} MoE ({c.num_experts} experts, top-{c.num_experts_per_tok})" if moe else "dense")
    weights = "float32 weights, gradients and AdamW state (autocast)" if run.master_weights else \
        f"{run.dtype} weights ({run.param_bytes + run.grad_bytes_ + run.optimizer_bytes_:g} bytes of state per parameter)"
    return [
        f"Model: GPT-MoE, {spec.total_params() / 1e9:,.2f}B parameters ({spec.active_params() / 1e9:,.2f}B active per "
        f"token), {spec.layers} layers, {shape}, hidden {c.hidden_size}, vocabulary {c.vocab_size}",
        f"Cluster: {result.cluster.describe()}",
        f"Run: {run.global_sequences(result.cluster.gpus)} sequences of {run.seq_len} tokens per step, {run.dtype} "
        f"compute, {weights}" + (", recomputation" if run.recompute else "") +
        (f", LoRA rank {run.lora_rank}" if run.lora_rank else "") + (", 4-bit experts" if run.experts_4bit else ""),
    ]


def _row(i: int, e: Estimate) -> str:
    m, t = e.memory, e.time
    memory = " / ".join(_gib(x) for x in (m.params, m.grads, m.optimizer, m.activations, m.gathered, m.buffers))
    time = " / ".join(f"{x:.2f}" for x in (t.compute, t.all_reduce, t.all_to_all, t.p2p, t.bubble, t.data_parallel,
                                           t.optimizer))
    flags = e.layout.flags() or "(none: data parallel)"
    return (f"| {i} | {e.layout.name()} | {flags} | {e.micro_batch} x {e.microbatches}{' (r)' if e.recompute else ''} "
            f"| {memory} = **{_gib(m.total)}** | {time} = **{t.total:.2f}** | {t.tokens_per_second:,.0f} |")


def format_plan(result: Plan, model: str = "--model_name_or_path MODEL", top: int = 10, before: str | None = None) -> str:
    """The plan as text: the fitting layouts (fastest first, `top` of them), the launch of the best (after `before`,
    e.g. the upcycling), the rejected ones with their reasons."""
    lines = describe(result) + [""]
    if result.fitting:
        lines += [f"Layouts that fit ({len(result.fitting)}), fastest first (r: activation recomputation):", "",
                  "| # | layout | training flags | micro-batch x steps | GiB per GPU: params / grads / optimizer / "
                  "activations / gathered / buffers | seconds per step: compute / all-reduce / all-to-all / pipeline "
                  "sends / bubble / data parallel / optimizer | tokens/s per GPU |",
                  "|---|---|---|---|---|---|---|"]
        lines += [_row(i, e) for i, e in enumerate(result.fitting[:top], 1)]
        if len(result.fitting) > top:
            lines.append(f"... {len(result.fitting) - top} more (--top)")
        lines += ["", "Launch the best (on every node):", ""] + ([f"    {before}"] if before else [])
        lines.append("    " + result.best.command(model, result.cluster, result.run))
        if not result.run.master_weights:
            lines.append("(hf_ppmoe.training keeps float32 weights under --mixed_precision; this plan assumed "
                         f"{result.run.dtype} weights: --no_master_weights.)")
    else:
        lines.append("No layout fits. Add GPUs, shorten --seq_len, use --recompute or a smaller --micro_batch.")
    if result.rejected:
        lines += ["", f"Rejected ({len(result.rejected)}):"]
        lines += [f"- {r.layout.name()}: {r.reason}" for r in result.rejected]
    return "\n".join(lines)


def plan_dict(result: Plan, model: str = "--model_name_or_path MODEL") -> dict:
    """The plan as JSON-ready data (`hf-ppmoe plan --json`)."""
    return {
        "model": {"total_parameters": result.spec.total_params(), "active_parameters": result.spec.active_params(),
                  "config": result.spec.config.to_diff_dict()},
        "cluster": {"gpu": result.cluster.gpu.name, "gpus": result.cluster.gpus,
                    "gpus_per_node": result.cluster.gpus_per_node, "memory_bytes": result.cluster.gpu.memory,
                    "usable": result.cluster.usable, "peak_flops": result.cluster.gpu.peak_flops,
                    "efficiency": result.cluster.gpu.efficiency, "hbm_bytes_per_s": result.cluster.gpu.hbm,
                    "nvlink_bytes_per_s": result.cluster.gpu.nvlink, "internode_bytes_per_s": result.cluster.internode,
                    "source": result.cluster.gpu.source},
        "run": dict(vars(result.run)),
        "fitting": [e.to_dict() | {"command": e.command(model, result.cluster, result.run)} for e in result.fitting],
        "rejected": [{"layout": r.layout.name(), "flags": r.layout.flags(), "reason": r.reason} for r in result.rejected],
    }


__all__ = ["describe", "format_plan", "plan", "plan_dict"]
