"""`parallelize`: tensor parallelism + PPMoE expert parallelism on a built model, over any tensor-parallel group.

It applies the model's own Transformers plan (`config.base_model_tp_plan`), the rules `from_pretrained(...,
distributed_config=DistributedConfig(tp_size=N))` applies, on a group you choose (a sub-mesh of a (pp, tp) mesh, a
pipeline stage, a model you changed): attention heads split (q/k/v colwise, o rowwise; T5's relative bias on the same
heads), dense FFNs and shared experts colwise / rowwise, MoE layers PPMoE (expert_parallel.py), vocabulary split
embeddings and head; norms and routers stay replicated. Our styles "replicated_input", "replicated_grad_sum",
"head_sharded_bias", "colwise_gathered" (the head) and "ppmoe_ffn" (an MoE layer's replicated router) are registered
here; docs/parallel.md says what each saves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from transformers import DistributedConfig
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
from transformers.distributed.expert_parallel import apply_expert_parallelism
from transformers.distributed.tensor_parallel import (ColwiseParallel, EmbeddingParallel, TensorParallelLayer,
                                                      apply_tensor_parallelism)

from ..modeling.parallel_hooks import tied_head_kept
from ..moe.layer import MoELayer
from ..utils.transformers_private import record_split, resolve_parallel_plans
from .comm import sum_grad_over
from .expert_parallel import ALL_TO_ALL, share_router_generator
from .modules import TensorParallel, become, show_plan


def _replicated(x, mesh):
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False)


class ReplicatedInputParallel(TensorParallelLayer):
    """Plan style "replicated_input": the module's first argument (and a cross-attention's `key_value_states`)
    enters the tensor-parallel region once, as a replicated DTensor (in training; inference keeps Transformers'
    local fast paths)."""

    def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
        if args:
            args = (_replicated(args[0], mesh), *args[1:])
        if kwargs.get("key_value_states") is not None:
            kwargs = {**kwargs, "key_value_states": _replicated(kwargs["key_value_states"], mesh)}
        return args, kwargs


class PPMoEFFNParallel(ReplicatedInputParallel):
    """Plan style "ppmoe_ffn" for the FFN slot. An MoE layer keeps its forward, gate then experts: its router stays
    replicated, drawing the same random numbers on every rank (`share_router_generator`), and its experts are split by
    their own rule ("ppmoe_experts"). A dense FFN gets "replicated_input", so its colwise projections share one
    input-gradient all-reduce."""

    def install_forward(self, module, mesh):
        if not isinstance(module, MoELayer):  # a dense FFN
            return super().install_forward(module, mesh)
        share_router_generator(module.gate, mesh.get_group(), mesh.device_type)
        return become(module, TensorParallel, "ppmoe_ffn", mesh)


class ReplicatedGradSumParallel(TensorParallelLayer):
    """Plan style "replicated_grad_sum": a replicated module whose parameter gradients are partial on each rank
    (Qwen3's q_norm / k_norm, which normalise only this rank's heads); they are summed over the group in every
    backward pass, by a hook on the gradient registered on the first forward after loading. Transformers'
    "replicated_with_grad_allreduce" all-reduces `param.grad` after accumulation instead, which under gradient
    accumulation sums the earlier micro-batches' already summed gradients again."""

    def install_forward(self, module, mesh):
        group = mesh.get_group()

        def hook(module, args):
            if torch.is_grad_enabled():
                for p in module.parameters(recurse=False):
                    if p.requires_grad:
                        sum_grad_over(p, group)

        module.register_forward_pre_hook(hook)
        return module


class HeadShardedBiasParallel(EmbeddingParallel):
    """Plan style "head_sharded_bias": a relative position bias table [buckets, heads] split on the heads, whose
    lookup stays this rank's heads (split as the attention's colwise q/k/v split them)."""

    def __init__(self):
        super().__init__(shard_dim=1)

    def transform_output_post_forward(self, module, output, mesh):
        return output.to_local() if isinstance(output, DTensor) else output


class _LocalTensorOf(torch.autograd.Function):
    """A replicated DTensor -> its local tensor's memory as a tensor of its own (no copy). `DTensor.to_local()`
    returns a view (`view_as`), and so, for some shapes, does the all-gather behind it (torch's chunk-cat of the
    gathered buffer); FSDP2 warns on every step that the model returned a view (an in-place op on one would skip
    FSDP's pre-backward hook). The memory is the head's gathered output, which nothing else holds."""

    @staticmethod
    def forward(ctx, x):
        ctx.mesh, ctx.placements, ctx.shape, ctx.stride = x.device_mesh, x.placements, x.shape, x.stride()
        local = x.to_local()
        own = torch.empty(0, dtype=local.dtype, device=local.device)
        return own.set_(local.untyped_storage(), local.storage_offset(), local.size(), local.stride())

    @staticmethod
    def backward(ctx, grad):
        return DTensor.from_local(grad, ctx.mesh, ctx.placements, run_check=False, shape=ctx.shape, stride=ctx.stride)


class ColwiseGatheredParallel(ColwiseParallel):
    """Plan style "colwise_gathered", the LM head's: Transformers' "colwise_gather_output" (the vocabulary split, the
    logits gathered whole on every rank) whose logits are a tensor of their own, not a view (`_LocalTensorOf`)."""

    def __init__(self):
        super().__init__(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=False)

    def transform_output_post_forward(self, module, output, mesh):
        output = super().transform_output_post_forward(module, output, mesh)
        return _LocalTensorOf.apply(output) if isinstance(output, DTensor) else output


ALL_PARALLEL_STYLES.register("replicated_input", ReplicatedInputParallel())
ALL_PARALLEL_STYLES.register("colwise_gathered", ColwiseGatheredParallel())
ALL_PARALLEL_STYLES.register("head_sharded_bias", HeadShardedBiasParallel())
ALL_PARALLEL_STYLES.register("replicated_grad_sum", ReplicatedGradSumParallel())
ALL_PARALLEL_STYLES.register("ppmoe_ffn", PPMoEFFNParallel())


def _mesh(group_or_mesh, model) -> DeviceMesh:
    if isinstance(group_or_mesh, DeviceMesh):
        if group_or_mesh.ndim != 1:
            raise ValueError(f"Pass a 1-D tensor-parallel mesh (e.g. mesh['tp']), got {group_or_mesh}.")
        return group_or_mesh
    device_type = next(model.parameters()).device.type
    return DeviceMesh.from_group(group_or_mesh, device_type)


def _check_split(config, tp_size: int, ep_size: int) -> None:
    """ValueError naming the sizes when experts or attention heads cannot be split evenly."""
    if config.num_experts % ep_size:
        how = "PPMoE gives every rank" if ep_size == tp_size else "expert parallelism gives every rank"
        raise ValueError(
            f"num_experts={config.num_experts} cannot be split evenly over {ep_size} ranks: {how} "
            f"num_experts / {ep_size} whole experts. Use a group size that divides {config.num_experts}."
        )
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if heads and heads % tp_size:
            raise ValueError(
                f"{name}={heads} cannot be split evenly over a tensor-parallel group of {tp_size} ranks: every rank "
                f"computes {name} / {tp_size} whole heads. Use a group size that divides {heads}."
            )


def parallelize(model, tp, ep: DeviceMesh | None = None):
    """Split `model` (a GPT-MoE or Seq2Seq-MoE, built or loaded: any model whose config carries our plans) in place
    over the tensor-parallel group `tp` (a `ProcessGroup` or a 1-D `DeviceMesh`) and return it.

    The weights and buffers of the group's first rank are broadcast to the others first, so ranks that built the
    model differently (another seed) hold one model. Parameters that are split become DTensors (`p.full_tensor()` /
    `p.grad.full_tensor()` gather them); the rest stay plain tensors with identical values and gradients on every
    rank. Gradients equal the single-device model's. `save_pretrained` afterwards (on every rank) writes the whole
    model from rank 0. `print(model)` shows every module a plan style changed (modules.py).

    `ep`: experts on more ranks than `tp` (`expert_mesh(mesh, ep_size).ep`, k tensor-parallel groups that read
    different batches): every MoE layer's experts are split over it and reached through Transformers' all-to-all
    (fsdp.py) instead of PPMoE; the rest is split over `tp` as before. Then shard the model with
    `fully_shard_model(model, mesh, experts)`, which also averages the experts' gradients over the data-parallel
    ranks. Gather such a model for saving from its state dict (`full_tensor()` of every entry), as hf_ppmoe.training
    does.
    """
    mesh = _mesh(tp, model)
    size = mesh.size()
    ep_size = size if ep is None or not model.ep_plan else ep.size()  # a pipeline stage may hold no experts
    _check_split(model.config, size, ep_size)
    if ep_size == size == 1:
        return model
    if ep_size == size:
        config = DistributedConfig(tp_size=size)
    else:  # Transformers checks ep against a (fsdp, tp) layout: these k groups are its fsdp ranks
        config = DistributedConfig(
            tp_size=size, fsdp_size=ep_size // size, ep_size=ep_size, ep_implementation=ALL_TO_ALL
        )
    tp_plan, ep_plan, _ = resolve_parallel_plans(model, config)
    if size > 1:
        broadcast_from_first_rank(model, mesh)
    with tied_head_kept(model):
        if size > 1:
            apply_tensor_parallelism(model, mesh, tp_plan)
            show_plan(model, tp_plan, mesh)
        if ep_size != size:
            apply_expert_parallelism(model, ep, mesh, ep_plan, ep_implementation=ALL_TO_ALL)
    # what `from_pretrained(distributed_config=...)` records, so `save_pretrained` gathers the split weights
    record_split(model, config, mesh, size)
    return model


@torch.no_grad()
def broadcast_from_first_rank(model, mesh: DeviceMesh) -> None:
    """Copy the group's first rank's parameters and buffers to the other ranks of `mesh` (what Megatron and DDP do
    when they start), before any is split. Every rank must pass the same model class and config."""
    group = mesh.get_group()
    for tensor in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values():
        dist.broadcast(tensor.data, group=group, group_src=0)
