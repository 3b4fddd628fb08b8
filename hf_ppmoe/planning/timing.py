"""Step time of a layout, from the data sheets' numbers (hardware.py) and one efficiency factor per GPU kind.

- compute: the GEMM FLOPs of this rank (forward once, backward twice, or once for a LoRA-frozen base, the forward
  again with recomputation) at
  peak x efficiency, plus the MoE layers' routing traffic (router probabilities, gathering each route's row, gathering
  the outputs back, the weighted sum: memory-bound, at the data sheet's HBM bandwidth). FLOPs per micro-batch of B
  sequences of S tokens (T = B S), per rank: attention projections 2TH(N + 2N_kv)D / tp + 2TNDH / tp, attention
  scores and weighted sum 2BS^2ND / tp (causal: half of 4BS^2ND); dense FFN 2THI(3 gated, else 2) / tp; MoE router 2THE
  (every tensor-parallel rank), experts 2RHI(3 or 2) with R the routes this rank's experts run (T K / tp balanced);
  the head 2THV / tp.
- tensor-parallel and expert-parallel collectives (communication.py) and a pipeline's sends: on the critical path.
- pipeline: (microbatches + stages - 1) slots of the slowest stage's micro-batch (1F1B and GPipe alike); the bubble
  is the stages - 1 extra slots.
- data parallel (FSDP's all-gathers and reduce-scatters, HSDP's and DDP's all-reduces): hidden behind the step's
  compute where `Run.overlap_data_parallel` (FSDP2 prefetches, DDP overlaps its buckets), else added.
- optimizer: AdamW reads the parameters, gradients and state and writes parameters and state, at HBM bandwidth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .communication import collective_time, micro_batch_collectives, step_collectives
from .hardware import Cluster
from .layouts import Layout, Rank, Run, split_layers
from .shapes import ModelSpec
from .state import held_params, lora_params


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the slowest rank, by part; `tokens_per_second` per GPU."""

    compute: float
    all_reduce: float  # tensor-parallel all-reduces and all-gathers
    all_to_all: float
    p2p: float  # pipeline sends
    bubble: float
    data_parallel: float  # the part not hidden behind compute
    optimizer: float
    total: float
    tokens_per_second: float

    def to_dict(self) -> dict:
        return asdict(self)


def routed_compute(spec: ModelSpec, layout: Layout, T: int) -> int:
    """Routes this rank's experts run per micro-batch of T tokens, balanced routing (R in the module docstring)."""
    K = spec.config.num_experts_per_tok
    if layout.all_to_all and layout.expert_tokens == "duplicated":
        return T * K
    return T * K // layout.tp


def forward_parts(spec: ModelSpec, layout: Layout, run: Run, stage: int, micro_batch: int) -> tuple[dict, dict]:
    """(GEMM FLOPs, memory-bound bytes) of one micro-batch's forward on `stage`, by part: "attention" (projections,
    scores), "ffn" (dense FFNs, shared experts), "gating" (routers), "experts" (routed experts, their routes' gathers),
    "head"."""
    c, a, tp = spec.config, run.act_bytes, layout.tp
    S = run.seq_len
    T = micro_batch * S
    H, N, N_kv, D = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    E, K, I = c.num_experts, c.num_experts_per_tok, spec.expert_inner
    gated = 3 if c.gated_mlp else 2
    flops = dict.fromkeys(("attention", "ffn", "gating", "experts", "head"), 0.0)
    traffic = dict.fromkeys(flops, 0.0)
    for layer in split_layers(spec.layers, layout.pp)[stage]:
        flops["attention"] += (2 * T * H * (N + 2 * N_kv) * D + 2 * T * N * D * H + 2 * micro_batch * S * S * N * D) / tp
        if spec.is_moe(layer):
            R = routed_compute(spec, layout, T)
            flops["gating"] += 2 * T * H * E
            traffic["gating"] += 16 * T * E
            flops["experts"] += 2 * R * H * I * gated
            traffic["experts"] += a * H * (2 * R + 3 * T * K + T)
            if c.shared_expert_intermediate_size:
                flops["ffn"] += 2 * T * H * c.shared_expert_intermediate_size * gated / tp
        else:
            flops["ffn"] += 2 * T * H * c.intermediate_size * gated / tp
    if stage == layout.pp - 1:
        flops["head"] += 2 * T * H * c.vocab_size / tp
    return flops, traffic


def _seconds(flops: dict, traffic: dict, cluster: Cluster) -> dict[str, float]:
    gpu = cluster.gpu
    return {k: flops[k] / (gpu.peak_flops * gpu.efficiency) + traffic[k] / gpu.hbm for k in flops}


def forward_breakdown(spec: ModelSpec, layout: Layout, run: Run, cluster: Cluster, stage: int,
                      micro_batch: int) -> dict[str, float]:
    """Forward seconds of one micro-batch on `stage` by part (`forward_parts`' parts, and its forward collectives:
    "attention_all_reduce", "ffn_all_reduce", "moe_all_reduce", "all_to_all", "p2p"), as PPMoE's Tables 1 and 3 split
    a forward step."""
    flops, traffic = forward_parts(spec, layout, run, stage, micro_batch)
    parts = _seconds(flops, traffic, cluster)
    T = micro_batch * run.seq_len
    for name in ("attention_all_reduce", "ffn_all_reduce", "moe_all_reduce", "all_to_all", "p2p"):
        parts[name] = 0.0
    for x in micro_batch_collectives(spec, layout, run, T, stage):
        if x.phase != "forward":
            continue
        seconds = collective_time(x, layout, cluster)
        if x.group == "pp":
            parts["p2p"] += seconds
        elif x.group == "ep":
            parts["all_to_all"] += seconds
        elif x.what in ("moe", "shared expert", "outputs"):
            parts["moe_all_reduce"] += seconds
        elif x.what == "dense_ffn":
            parts["ffn_all_reduce"] += seconds
        else:
            parts["attention_all_reduce"] += seconds
    return parts


def step_time(spec: ModelSpec, layout: Layout, run: Run, cluster: Cluster, micro_batch: int,
              microbatches: int) -> StepTime:
    """One optimizer step of `microbatches` micro-batches of `micro_batch` sequences on every data-parallel rank."""
    gpu = cluster.gpu
    T = micro_batch * run.seq_len
    # forward, backward (twice the forward: input and weight gradients; a frozen base under LoRA only the input's),
    # recomputed forward
    passes = (2 if run.lora_rank else 3) + bool(run.recompute)
    slots, comm, dp_seconds, optimizer = [], [], [], []
    for stage in range(layout.pp):
        flops, traffic = forward_parts(spec, layout, run, stage, micro_batch)
        compute = sum(_seconds({k: v * passes for k, v in flops.items()},
                               {k: v * 3 for k, v in traffic.items()}, cluster).values())
        parts = {"all_reduce": 0.0, "all_to_all": 0.0, "p2p": 0.0}
        for x in micro_batch_collectives(spec, layout, run, T, stage):
            kind = "p2p" if x.group == "pp" else "all_to_all" if x.group == "ep" else "all_reduce"
            parts[kind] += collective_time(x, layout, cluster)
        slots.append((compute, parts))
        rank = Rank(0, 0, stage, 0)
        dp_seconds.append(sum(collective_time(x, layout, cluster)
                              for x in step_collectives(spec, layout, run, rank, microbatches) if x.group != "pp"))
        held = held_params(spec, layout, run, rank)
        trainable = sum(h.numel for h in held if h.trainable) or lora_params(spec, run, [h.param for h in held])
        if layout.zero1:  # each data-parallel rank updates its shard of the optimizer state
            trainable /= layout.data_parallel
        per_param = 2 * run.param_bytes + run.grad_bytes_ + 2 * run.optimizer_bytes_
        optimizer.append(trainable * per_param / gpu.hbm)
    slot = max(compute + sum(parts.values()) for compute, parts in slots)
    worst_compute, worst_parts = max(slots, key=lambda s: s[0] + sum(s[1].values()))
    pipelined = (microbatches + layout.pp - 1) * slot
    bubble = (layout.pp - 1) * slot
    compute_total = microbatches * worst_compute
    dp = max(dp_seconds)
    exposed = max(0.0, dp - compute_total) if run.overlap_data_parallel else dp
    total = pipelined + exposed + max(optimizer)
    tokens = run.global_sequences(cluster.gpus) * run.seq_len
    return StepTime(
        compute=compute_total,
        all_reduce=microbatches * worst_parts["all_reduce"],
        all_to_all=microbatches * worst_parts["all_to_all"],
        p2p=microbatches * worst_parts["p2p"],
        bubble=bubble,
        data_parallel=exposed,
        optimizer=max(optimizer),
        total=total,
        tokens_per_second=tokens / total / layout.world,
    )


__all__ = ["StepTime", "forward_breakdown", "forward_parts", "routed_compute", "step_time"]
