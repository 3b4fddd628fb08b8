"""Sharded data parallelism (FSDP2, HSDP) for our models and pipeline stages, and experts spread across data-parallel
ranks (expert parallelism wider than the tensor-parallel group).

`fully_shard_model(module, mesh)` applies torch's FSDP2 `fully_shard` from outside, after any tensor or expert
parallelism: one FSDP group per decoder layer, the rest (embeddings, final norms, head) in the root group; HSDP on a
(dp, fsdp) mesh with both > 1. With `parallelize(model, tp, ep=...)` (ep = k x tp) each MoE layer's experts are split
over k tensor-parallel groups that read different batches and reached by Transformers' all-to-all
(expert_parallel.py: `AllToAllWithDrops`); FSDP shards each experts module over its copies
(`ExpertMesh.replicas`).

docs/parallel.md says why FSDP2 rather than Transformers' or Accelerate's FSDP.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from .mesh import ExpertMesh
from .modules import ExpertParallel

def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards on: (dp, fsdp) (HSDP) when there are replicas, else (fsdp,)."""
    return mesh["dp", "fsdp"] if mesh["dp"].size() > 1 else mesh["fsdp"]


def fully_shard_model(module: nn.Module, mesh: DeviceMesh, experts: ExpertMesh | None = None, *,
                      reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 on `module` (a model or a `Pipeline` stage) over the dp and fsdp dims of a `make_mesh` mesh, after any
    tensor / expert parallelism (see the module docstring); returns it. Build the optimizer afterwards: the
    parameters become sharded DTensors. `experts`: the `expert_mesh` the model's experts were split on with
    `parallelize(..., ep=experts.ep)`. `reshard_after_forward=False` keeps each layer's gathered parameters from its
    forward to its backward (ZeRO-2, FSDP1's SHARD_GRAD_OP: more memory, one all-gather per layer fewer)."""
    shard_mesh = data_parallel_mesh(mesh)
    if experts is not None:
        data_parallel = mesh["dp"].size() * mesh["fsdp"].size()
        copies = experts.replicas["efsdp"].size()
        for m in module.modules():
            if isinstance(m, ExpertParallel):  # split by Transformers' grouped_gemm rule on experts.ep
                fully_shard(m, mesh=experts.replicas, reshard_after_forward=reshard_after_forward)
                m.set_gradient_divide_factor(float(data_parallel))
                # FSDP applies a divide factor other than the group size with PREMUL_SUM, which gloo lacks (and NCCL
                # zeroes in bf16, pytorch#190747): sum, then divide locally. Without a reduce-scatter (one copy) FSDP
                # already divides by the factor.
                if copies > 1:
                    m.set_force_sum_reduction_for_comms(True)
    for name, layers in module.named_modules():
        if isinstance(layers, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            for layer in layers:
                fully_shard(layer, mesh=shard_mesh, reshard_after_forward=reshard_after_forward)
    return fully_shard(module, mesh=shard_mesh, reshard_after_forward=reshard_after_forward)


def set_gradient_sync(module: nn.Module, sync: bool) -> None:
    """Reduce gradients in this backward (the last micro-step) or only accumulate them locally (the others)."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(sync)


def _reduced_over(grad) -> tuple:
    """The process groups a gradient's local sum of squares must be summed over: its DTensor's sharded mesh dims."""
    if not isinstance(grad, DTensor):
        return ()
    groups = []
    for dim, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError(f"A gradient with a Partial placement ({grad.placements}): reduce it before its norm.")
        if not isinstance(placement, Replicate):  # Shard, or FSDP's _StridedShard under tensor parallelism
            groups.append(grad.device_mesh.get_group(dim))
    return tuple(groups)


@torch.no_grad()
def clip_grad_norm_(
    parameters, max_norm: float, norm_type: float = 2.0, *, norm_parameters=None, group=None
) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` (its arguments and result; the 2-norm only) for parameters split by any
    layout here: plain tensors, tensor-parallel and FSDP DTensors (each gradient's local sum of squares, summed over
    the groups its shards span: one all-reduce per kind of placement, not per parameter), and pipeline stages
    (`group`: the squares also summed over it). `norm_parameters` (default: `parameters`) are those the norm counts (a
    parameter several stages hold, once); every gradient in `parameters` is scaled (`max_norm=math.inf`: none). No
    host sync. Returns the norm before clipping."""
    if float(norm_type) != 2.0:
        raise ValueError(f"norm_type={norm_type}: hf_ppmoe.parallel.clip_grad_norm_ computes the 2-norm only.")
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    parameters = [p for p in parameters if p.grad is not None]
    counted = parameters if norm_parameters is None else [p for p in norm_parameters if p.grad is not None]
    device = parameters[0].grad.device if parameters else torch.device("cpu")
    partial: dict[tuple, torch.Tensor] = {}
    for p in counted:
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        key = _reduced_over(p.grad)
        partial[key] = partial.get(key, 0) + torch.linalg.vector_norm(local, dtype=torch.float32) ** 2
    squares = torch.zeros((), device=device)
    for groups, value in partial.items():  # the same keys, in the same order, on every rank of each group
        for g in groups:
            dist.all_reduce(value, group=g)
        squares += value
    if group is not None:
        dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    if not math.isinf(max_norm):
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        torch._foreach_mul_([p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters], scale)
    return total


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds of the parameters, their gradients and the optimizer state (its local shards)."""

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def size(tensors):
        return sum(local(t).numel() * local(t).element_size() for t in tensors if isinstance(t, torch.Tensor))

    params = list(model.parameters())
    states = [] if optimizer is None else [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    return {"params": size(params), "grads": size(p.grad for p in params), "optimizer": size(states)}
