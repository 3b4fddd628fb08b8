"""Every layout of a model on a cluster: its per-rank memory and step time, ranked; why each rejected one does not
fit or cannot run (`plan`).

For each layout hf_ppmoe.training can run (`Layout.problem`), micro-batches of 1, 2, 4, ... sequences are tried (or
the one given) and the fastest that fits is kept: per-rank memory (the largest rank of every pipeline stage: the
first of its FSDP and tensor-parallel groups holds the largest shards) within `Cluster.usable` of the GPU's memory.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from .activations import stage_bytes, weight_copies
from .hardware import Cluster
from .layouts import Layout, Rank, Run, microbatches, pipeline_in_flight
from .shapes import ModelSpec
from .state import buffer_bytes, gathered_bytes, held_params, state_bytes
from .timing import StepTime, step_time

MAX_MICRO_BATCH = 64


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank, by kind."""

    params: float
    grads: float
    optimizer: float
    activations: float
    gathered: float  # FSDP's gathered layers at their peak
    buffers: float  # communication buffers

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.gathered + self.buffers


def rank_memory(spec: ModelSpec, layout: Layout, run: Run, rank: Rank, micro_batch: int, microbatches_: int) -> Memory:
    state = state_bytes(spec, layout, run, rank)
    in_flight = pipeline_in_flight(layout, rank.stage, microbatches_)
    activations = stage_bytes(spec, layout, run, rank.stage, micro_batch) * in_flight
    activations += weight_copies(held_params(spec, layout, run, rank), run, in_flight)
    return Memory(state["params"], state["grads"], state["optimizer"], activations,
                  gathered_bytes(spec, layout, run, rank), buffer_bytes(spec, layout, run, rank,
                                                                         micro_batch * run.seq_len))


def worst_memory(spec: ModelSpec, layout: Layout, run: Run, micro_batch: int, microbatches_: int) -> Memory:
    """The fullest rank: the first rank of each stage (largest FSDP and tensor-parallel shards)."""
    return max((rank_memory(spec, layout, run, Rank(0, 0, s, 0), micro_batch, microbatches_) for s in range(layout.pp)),
               key=lambda m: m.total)


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    micro_batch: int
    microbatches: int  # micro-steps (pipeline microbatches) per optimizer step
    recompute: bool
    memory: Memory
    time: StepTime

    def command(self, model: str, cluster: Cluster, run: Run) -> str:
        """The `python -m hf_ppmoe.training` launch of this estimate (torchrun; one line per node)."""
        nodes, per_node = cluster.nodes, min(cluster.gpus, cluster.gpus_per_node)
        launch = f"torchrun --nproc-per-node {per_node}" + (f" --nnodes {nodes} --node-rank $NODE_RANK "
                                                            f"--master-addr $MASTER_ADDR" if nodes > 1 else "")
        precision = {"bfloat16": " --mixed_precision bf16", "float16": " --mixed_precision fp16"}.get(run.dtype, "")
        parts = [launch, "-m hf_ppmoe.training", model, self.layout.flags(), f"--block_size {run.seq_len}",
                 f"--per_device_train_batch_size {self.micro_batch}",
                 f"--gradient_accumulation_steps {self.microbatches}" + precision]
        return " ".join(p for p in parts if p)

    def to_dict(self) -> dict:
        memory = asdict(self.memory) | {"total": self.memory.total}
        return {"layout": asdict(self.layout) | {"name": self.layout.name(), "flags": self.layout.flags()},
                "micro_batch": self.micro_batch, "microbatches": self.microbatches, "recompute": self.recompute,
                "memory_bytes": memory, "step_seconds": self.time.to_dict()}


@dataclass
class Rejected:
    layout: Layout
    reason: str
    estimate: Estimate | None = None  # the smallest micro-batch's, when memory is the reason


@dataclass
class Plan:
    """Layouts that fit, fastest first (`fitting`), and those that do not (`rejected`, with the reason)."""

    spec: ModelSpec
    cluster: Cluster
    run: Run
    fitting: list[Estimate] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)

    @property
    def best(self) -> Estimate | None:
        return self.fitting[0] if self.fitting else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(gpus: int) -> list[Layout]:
    """Every (dp, fsdp, pp, tp, ep) whose ranks make `gpus`; ep = tp (PPMoE) or k x tp with k dividing fsdp."""
    out = []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            for fsdp in _divisors(gpus // (tp * pp)):
                dp = gpus // (tp * pp * fsdp)
                for k in _divisors(fsdp):
                    out.append(Layout(tp=tp, pp=pp, fsdp=fsdp, dp=dp, ep=None if k == 1 else k * tp))
    return out


def estimate(spec: ModelSpec, layout: Layout, run: Run, cluster: Cluster, micro_batch: int) -> Estimate | str:
    """The estimate of one layout at one micro-batch size, or why that size cannot be used."""
    steps = microbatches(layout, run, micro_batch, cluster.gpus)
    if steps is None:
        return (f"a global batch of {run.global_sequences(cluster.gpus)} sequences does not split into micro-batches "
                f"of {micro_batch} on {layout.data_parallel} data-parallel ranks")
    memory = worst_memory(spec, layout, run, micro_batch, steps)
    return Estimate(layout, micro_batch, steps, bool(run.recompute), memory,
                    step_time(spec, layout, run, cluster, micro_batch, steps))


def best_estimate(spec: ModelSpec, layout: Layout, run: Run, cluster: Cluster) -> Estimate | Rejected:
    """The fastest micro-batch (and recomputation, when `run.recompute` is None) that fits, else why none does."""
    limit = cluster.usable * cluster.gpu.memory
    sizes = [run.micro_batch] if run.micro_batch else [2**i for i in range(int(math.log2(MAX_MICRO_BATCH)) + 1)]
    choices = [False, True] if run.recompute is None else [run.recompute]
    best, smallest, reasons = None, None, []
    for recompute in choices:
        trial = replace(run, recompute=recompute)
        for b in sizes:
            result = estimate(spec, layout, trial, cluster, b)
            if isinstance(result, str):
                reasons.append(result)
                continue
            smallest = smallest or result
            if result.memory.total > limit:
                break  # larger micro-batches only need more
            if best is None or result.time.tokens_per_second > best.time.tokens_per_second:
                best = result
    if best is not None:
        return best
    if smallest is None:
        return Rejected(layout, reasons[0] if reasons else "no micro-batch size to try")
    m = smallest.memory
    return Rejected(layout, f"needs {m.total / 2**30:,.1f} GiB per GPU at micro-batch {smallest.micro_batch} "
                            f"(state {(m.params + m.grads + m.optimizer) / 2**30:,.1f}, activations "
                            f"{m.activations / 2**30:,.1f}, gathered {m.gathered / 2**30:,.1f}); "
                            f"{limit / 2**30:,.1f} GiB usable", smallest)


def plan_layouts(spec: ModelSpec, cluster: Cluster, run: Run, candidates: list[Layout] | None = None) -> Plan:
    """Every candidate layout (default: all of `layouts(cluster.gpus)`) estimated, the fitting ones ranked by
    tokens per second per GPU."""
    result = Plan(spec, cluster, run)
    for layout in candidates or layouts(cluster.gpus):
        problem = layout.problem(spec.config, cluster.gpus)
        if problem:
            result.rejected.append(Rejected(layout, problem))
            continue
        outcome = best_estimate(spec, layout, run, cluster)
        (result.rejected if isinstance(outcome, Rejected) else result.fitting).append(outcome)
    result.fitting.sort(key=lambda e: -e.time.tokens_per_second)
    return result


__all__ = ["Estimate", "Memory", "Plan", "Rejected", "best_estimate", "estimate", "layouts", "plan_layouts",
           "rank_memory", "worst_memory"]
