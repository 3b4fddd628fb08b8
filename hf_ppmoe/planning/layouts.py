"""A layout (how the GPUs split the model and the batch) and a run (what one training step does), in the words of
`python -m hf_ppmoe.training`: WORLD_SIZE = replicas x fsdp_size x pp_size x tp_size, ranks ordered (dp, fsdp, pp,
tp) with tp innermost (`hf_ppmoe.parallel.make_mesh`). Standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# bitsandbytes NF4 (Dettmers et al. 2023): 4 bits per weight and one float32 absmax per block of 64 weights
NF4_BYTES = 0.5 + 4 / 64


@dataclass(frozen=True)
class Layout:
    """Sizes of each kind of parallelism. `ep`: the ranks every MoE layer's experts are split over (None: `tp`,
    PPMoE); ep = k x tp with k > 1 spreads them over k tensor-parallel groups that read different batches (all-to-
    all). The last three fields describe layouts hf_ppmoe.training does not build (`problem` refuses them), for
    comparisons: `expert_tokens="duplicated"` (DeepSpeed-MoE before its PR 2074: every tensor-parallel rank sends the
    whole batch through the all-to-all and its experts), `zero1` (DeepSpeed ZeRO stage 1: optimizer state sharded
    over the data-parallel ranks, parameters and gradients whole), `ep_implementation="all_to_all"` with ep == tp
    (Transformers' all-to-all expert parallelism over the tensor-parallel group)."""

    tp: int = 1
    pp: int = 1
    fsdp: int = 1
    dp: int = 1  # replicas
    ep: int | None = None
    expert_tokens: str = "sliced"
    zero1: bool = False
    ep_implementation: str | None = None

    @property
    def world(self) -> int:
        return self.dp * self.fsdp * self.pp * self.tp

    @property
    def ep_size(self) -> int:
        return self.ep or self.tp

    @property
    def all_to_all(self) -> bool:
        return self.ep_size > self.tp or self.ep_implementation == "all_to_all"

    @property
    def expert_group(self) -> int:
        """Ranks every MoE layer's experts are split over: ep, or with `expert_tokens="duplicated"` only the ep / tp
        data-parallel ranks of one tensor-parallel index (each of whose tp ranks holds the same experts)."""
        return self.ep_size // self.tp if self.expert_tokens == "duplicated" else self.ep_size

    @property
    def data_parallel(self) -> int:
        """Ranks that read different batches."""
        return self.dp * self.fsdp

    @property
    def split(self) -> bool:
        """Whether hf_ppmoe.training splits the model (a mesh, FSDP2 over the data-parallel ranks); else
        Accelerate's DDP with whole copies."""
        return self.tp * self.pp * self.fsdp > 1 or self.all_to_all

    @property
    def fsdp_applied(self) -> bool:
        """Whether FSDP2 manages the parameters (every data-parallel rank of a split model; with fsdp 1 the replicas
        are HSDP with shard groups of one)."""
        return self.split and self.data_parallel > 1

    @property
    def sharded(self) -> int:
        """Ranks FSDP shards the non-expert parameters over (1: not sharded; ZeRO-1 shards only the optimizer)."""
        return self.fsdp if self.fsdp_applied and not self.zero1 else 1

    @property
    def expert_copies(self) -> int:
        """FSDP shards of each expert: with all-to-all, over the fsdp / k ranks holding the same experts."""
        if self.zero1:
            return 1
        return self.fsdp // (self.ep_size // self.tp) if self.all_to_all else self.sharded

    def name(self) -> str:
        sizes = (("dp", self.dp), ("fsdp", self.fsdp), ("pp", self.pp), ("tp", self.tp))
        text = " x ".join(f"{k} {v}" for k, v in sizes if v > 1) or "1 GPU"
        return text + (f" (ep {self.ep_size}, all-to-all)" if self.all_to_all else "")

    def flags(self) -> str:
        """The layout as `python -m hf_ppmoe.training` flags (replicas: the processes left over)."""
        parts = [f"--{name}_size {value}" for name, value in (("tp", self.tp), ("pp", self.pp), ("fsdp", self.fsdp))
                 if value > 1]
        if self.all_to_all:
            parts.append(f"--ep_size {self.ep_size}")
        return " ".join(parts)

    def problem(self, config, world: int) -> str | None:
        """Why hf_ppmoe.training cannot run this layout for `config` on `world` processes (its own checks:
        training/arguments.py, parallel/tensor_parallel.py, parallel/pipeline.py), or None."""
        if self.world != world:
            return f"{self.name()} is {self.world} processes, not {world}"
        if self.expert_tokens != "sliced" or self.zero1 or self.ep_implementation:
            return "a layout of another system (expert_tokens, zero1, ep_implementation), not of hf_ppmoe.training"
        heads = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
        for name, value in heads.items():
            if value % self.tp:
                return f"tp {self.tp} does not divide {name}={value}"
        if config.num_experts % self.ep_size:
            return f"{'ep' if self.all_to_all else 'tp'} {self.ep_size} does not divide num_experts={config.num_experts}"
        if self.all_to_all and (self.ep_size % self.tp or self.fsdp % (self.ep_size // self.tp)):
            return f"ep {self.ep_size} must be tp {self.tp} times a divisor of fsdp {self.fsdp}"
        if self.pp > config.num_hidden_layers:
            return f"pp {self.pp} exceeds the {config.num_hidden_layers} layers"
        return None


@dataclass(frozen=True)
class Run:
    """What one optimizer step does. `micro_batch`: sequences per rank per forward (None: the planner tries powers of
    two and keeps the fastest that fits); `global_batch`: sequences per optimizer step (None: 16 per GPU), reached
    with gradient accumulation, or with a pipeline's microbatches."""

    seq_len: int = 2048
    micro_batch: int | None = None
    global_batch: int | None = None
    dtype: str = "bfloat16"  # what the layers compute in: activations (and weights without master_weights)
    master_weights: bool = False  # float32 weights, gradients and AdamW state under autocast (hf_ppmoe.training
    # --mixed_precision): autocast's 16-bit copies of the weights are saved for the backward too
    grad_bytes: float | None = None  # per parameter; None: the weights'
    optimizer_bytes: float | None = None  # per trainable parameter; None: AdamW's two moments in the weights' dtype
    recompute: bool | None = False  # activation checkpointing of every decoder layer (None: where nothing else fits)
    lora_rank: int = 0  # > 0: LoRA adapters of this rank train, the base weights are frozen
    experts_4bit: bool = False  # the experts' weights stored as bitsandbytes NF4 (frozen)
    reshard_after_forward: bool = True  # FSDP2: free each layer's gathered parameters after its forward
    overlap_data_parallel: bool = True  # data-parallel gradient and parameter traffic hidden behind compute

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r}: use one of {', '.join(DTYPE_BYTES)}.")
        for name in ("seq_len", "micro_batch", "global_batch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        if self.experts_4bit and not self.lora_rank:
            raise ValueError("4-bit experts are frozen (bitsandbytes NF4 weights take no gradient): give a LoRA rank "
                             "to train adapters on them.")

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def stream_bytes(self) -> int:
        """Bytes per element of the residual stream (what crosses ranks between layers): float32 under autocast."""
        return 4 if self.master_weights else DTYPE_BYTES[self.dtype]

    @property
    def param_bytes(self) -> int:
        return 4 if self.master_weights else DTYPE_BYTES[self.dtype]

    @property
    def grad_bytes_(self) -> float:
        return self.grad_bytes if self.grad_bytes is not None else self.param_bytes

    @property
    def optimizer_bytes_(self) -> float:
        return self.optimizer_bytes if self.optimizer_bytes is not None else 2 * self.param_bytes

    @property
    def weight_copies(self) -> bool:
        """Whether autocast keeps 16-bit copies of the weights for the backward."""
        return self.master_weights and self.dtype != "float32"

    def global_sequences(self, gpus: int) -> int:
        return self.global_batch or 16 * gpus


def microbatches(layout: Layout, run: Run, micro_batch: int, gpus: int) -> int | None:
    """Micro-steps (or pipeline microbatches) per optimizer step, None when the global batch does not split evenly."""
    per_rank = run.global_sequences(gpus)
    if per_rank % (layout.data_parallel * micro_batch):
        return None
    return per_rank // (layout.data_parallel * micro_batch)


def pipeline_in_flight(layout: Layout, stage: int, microbatches_: int) -> int:
    """Microbatches whose activations a stage holds at once: hf_ppmoe.training runs 1F1B when there are at least as
    many microbatches as stages (stage s holds pp - s; torch's Schedule1F1B), else GPipe (all of them)."""
    if layout.pp == 1:
        return 1
    if microbatches_ >= layout.pp:
        return min(microbatches_, layout.pp - stage)
    return microbatches_


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """hf_ppmoe.parallel.split_layers: contiguous, as even as possible (the first stages take one more)."""
    size, extra = divmod(num_layers, num_stages)
    starts = [i * size + min(i, extra) for i in range(num_stages + 1)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def chunk(size: int, parts: int, index: int) -> int:
    """Elements of `size` that part `index` of `parts` holds, as torch.chunk (DTensor's Shard, FSDP2) splits: the
    first parts ceil(size / parts) each, the last what is left (possibly none)."""
    if parts == 1:
        return size
    each = math.ceil(size / parts)
    return max(0, min(each, size - index * each))


@dataclass(frozen=True)
class Rank:
    """Where a process sits in a layout: its data-parallel replica, FSDP shard, pipeline stage and tensor-parallel
    rank (global rank = ((dp * fsdp_size + fsdp) * pp_size + stage) * tp_size + tp)."""

    dp: int
    fsdp: int
    stage: int
    tp: int

    @classmethod
    def of(cls, layout: Layout, rank: int) -> Rank:
        rank, tp = divmod(rank, layout.tp)
        rank, stage = divmod(rank, layout.pp)
        dp, fsdp = divmod(rank, layout.fsdp)
        return cls(dp, fsdp, stage, tp)

    def expert_rank(self, layout: Layout) -> tuple[int, int]:
        """(index in the expert group, index among the FSDP shards of those experts)."""
        if not layout.all_to_all:
            return self.tp, self.fsdp if layout.sharded > 1 else 0
        k = layout.ep_size // layout.tp
        if layout.expert_tokens == "duplicated":
            return self.fsdp % k, self.fsdp // k
        return (self.fsdp % k) * layout.tp + self.tp, self.fsdp // k


__all__ = ["DTYPE_BYTES", "NF4_BYTES", "Layout", "Rank", "Run", "chunk", "microbatches", "pipeline_in_flight",
           "split_layers"]
