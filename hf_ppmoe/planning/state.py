"""Bytes of state one rank holds: its parameters, their gradients and the optimizer state (as
`hf_ppmoe.parallel.state_bytes` counts them: the local shards), FSDP's gathered layers while they are in use, and
communication buffers.

Each parameter is followed through what hf_ppmoe.training does to it: a pipeline stage keeps its layers (the first
also the embeddings, the last the final norm and the head: a copy of the embeddings when they are tied); tensor
parallelism splits it as its plan style says (torch.chunk sizes: DTensor's `Shard`), expert parallelism splits the
experts over the expert group; FSDP2 then splits dim 0 of what is left over its shards (torch.chunk again; the padding
to equal shards that it allocates is not counted, as `state_bytes` does not count it). The vocabulary-split input
embedding's gradient comes back whole under tensor parallelism when FSDP2 does not manage it, unless the embedding is tied to the
head (whose vocabulary-split gradient it is then added to, or aligned with by the pipeline): measured, benchmarks/plan.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layouts import NF4_BYTES, Layout, Rank, Run, chunk, split_layers
from .shapes import ModelSpec, Param


@dataclass(frozen=True)
class Held:
    """One parameter as a rank holds it: elements of its local shard, of its gradient, and whether it trains."""

    param: Param
    numel: int
    grad_numel: int
    trainable: bool
    gathered: int  # elements FSDP gathers it into (its tensor-parallel shard, dim 0 padded to equal shards); 0: not
    # sharded
    shards: int  # FSDP shards of it (1: not sharded)
    apart: bool  # routed experts spread by all-to-all: fully_shard_model gives them an FSDP group of their own
    tied_head: bool = False  # the input embedding, which the head on this stage also multiplies by

    @property
    def unit(self):
        """Its FSDP group: its layer (None: the root group), or ("experts", layer)."""
        return ("experts", self.param.layer) if self.apart else self.param.layer


def stage_params(spec: ModelSpec, layout: Layout, stage: int) -> list[Param]:
    """The parameters pipeline stage `stage` holds (every parameter when pp == 1)."""
    if layout.pp == 1:
        return list(spec.params)
    layers = split_layers(spec.layers, layout.pp)[stage]
    first, last = stage == 0, stage == layout.pp - 1
    held = []
    for p in spec.params:
        if p.part == "layer" and p.layer in layers or p.part == "input" and first or p.part == "output" and last:
            held.append(p)
    if last and spec.tied and not first:  # the head's copy of the tied embedding
        embedding = next(p for p in spec.params if p.name == "model.embed_tokens.weight")
        held.append(Param("lm_head.weight", embedding.shape, 0, "colwise_gathered", None, False))
    return held


def _local_shape(p: Param, layout: Layout, rank: Rank) -> list[int]:
    shape = list(p.shape)
    if p.split is None:
        return shape
    if p.expert:
        group, index = layout.expert_group, rank.expert_rank(layout)[0]
    else:
        group, index = layout.tp, rank.tp
    shape[p.split] = chunk(shape[p.split], group, index)
    return shape


def held_params(spec: ModelSpec, layout: Layout, run: Run, rank: Rank) -> list[Held]:
    """Every parameter `rank` holds, with its local sizes."""
    held = []
    for p in stage_params(spec, layout, rank.stage):
        shape = _local_shape(p, layout, rank)
        whole = 1
        for d in shape:
            whole *= d
        shards, index = (layout.expert_copies, rank.expert_rank(layout)[1]) if p.expert else \
            (layout.sharded, rank.fsdp)
        rows = shape[0]
        numel = whole // rows * chunk(rows, shards, index) if shards > 1 else whole
        padded = whole // rows * -(-rows // shards) * shards if shards > 1 else 0
        grad = numel
        if p.style == "embedding_rowwise" and layout.tp > 1 and not layout.fsdp_applied and not spec.tied:
            grad = p.numel  # comes back whole, unless the tied head's sharded gradient is added to it (measured)
        trainable = run.lora_rank == 0
        head = spec.tied and p.name == "model.embed_tokens.weight" and rank.stage == layout.pp - 1
        held.append(Held(p, numel, grad if trainable else 0, trainable, padded, shards, p.expert and layout.all_to_all,
                         head))
    return held


def lora_params(spec: ModelSpec, run: Run, params: list[Param]) -> int:
    """LoRA adapter elements for `params` (PEFT, hf_ppmoe.peft.lora_config: every linear layer but the head, and every
    expert weight matrix with one rank-r pair per expert); kept whole on every rank."""
    r, total = run.lora_rank, 0
    for p in params:
        if p.name.startswith("lm_head") or p.name.endswith("bias") or len(p.shape) < 2 or ".gate." in p.name:
            continue
        if p.name.startswith("model.embed"):
            continue
        if p.expert:  # [E, out, in]: lora_A [E * r, in], lora_B [out, E * r]
            total += p.shape[0] * r * (p.shape[1] + p.shape[2])
        else:
            total += r * (p.shape[0] + p.shape[1])
    return total


def state_bytes(spec: ModelSpec, layout: Layout, run: Run, rank: Rank) -> dict[str, float]:
    """{"params", "grads", "optimizer"} bytes `rank` holds after a step (hf_ppmoe.parallel.state_bytes' count)."""
    held = held_params(spec, layout, run, rank)
    expert_bytes = NF4_BYTES if run.experts_4bit else run.param_bytes
    params = sum(h.numel * (expert_bytes if h.param.expert else run.param_bytes) for h in held)
    grads = sum(h.grad_numel for h in held) * run.grad_bytes_
    trainable = sum(h.numel for h in held if h.trainable)
    if run.lora_rank:
        adapters = lora_params(spec, run, [h.param for h in held])
        params += adapters * run.param_bytes
        grads += adapters * run.grad_bytes_
        trainable = adapters
    optimizer = trainable * run.optimizer_bytes_
    if layout.zero1 and layout.data_parallel > 1:
        optimizer /= layout.data_parallel
    return {"params": params, "grads": grads, "optimizer": optimizer}


def gathered_bytes(spec: ModelSpec, layout: Layout, run: Run, rank: Rank) -> float:
    """FSDP's gathered layers at their peak, in the backward pass: the layer computing (its parameters and their
    unsharded gradients before the reduce-scatter) and the next one prefetched; the root group (embeddings, final norm,
    head) stays gathered through the step. With `reshard_after_forward=False` every layer stays gathered from its
    forward to its backward. 0 without FSDP."""
    units: dict[object, float] = {}
    for h in held_params(spec, layout, run, rank):
        if h.gathered:
            units[h.unit] = units.get(h.unit, 0) + h.gathered * run.param_bytes
    if not units:
        return 0.0
    root = units.pop(None, 0.0)
    layers = sorted(units.values(), reverse=True)
    if not run.reshard_after_forward:
        return root + sum(layers) + (layers[0] * run.grad_bytes_ / run.param_bytes if layers else 0)
    largest = layers[0] if layers else 0.0
    second = layers[1] if len(layers) > 1 else 0.0
    return root + largest * (1 + run.grad_bytes_ / run.param_bytes) + second


def buffer_bytes(spec: ModelSpec, layout: Layout, run: Run, rank: Rank, tokens: int) -> float:
    """Communication buffers: DDP's gradient buckets (a second copy of the gradients: Accelerate's DDP without
    `gradient_as_bucket_view`), and the all-to-all's send and receive rows of one MoE layer."""
    total = 0.0
    if not layout.split and layout.data_parallel > 1:
        total += state_bytes(spec, layout, run, rank)["grads"]
    if layout.all_to_all and spec.moe_layers:
        c = spec.config
        total += 2 * tokens // layout.tp * c.num_experts_per_tok * c.hidden_size * run.act_bytes
    return total


__all__ = ["Held", "buffer_bytes", "gathered_bytes", "held_params", "lora_params", "stage_params", "state_bytes"]
