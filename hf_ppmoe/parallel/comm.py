"""Named autograd collectives on plain `torch.distributed` process groups, and a collective counter.

Megatron's pair, which PPMoE Algorithm 1 puts around an MoE layer:

    copy_to(x, group)       forward: identity            backward: all-reduce (sum) of the gradient
    reduce_from(x, group)   forward: all-reduce (sum)    backward: identity

A replicated activation entering a region where every rank computes only part of the result goes through
`copy_to` (each rank's input gradient is partial, so they are summed); the partial results leave through
`reduce_from`.

`sum_grad_over(param, group)` sums a replicated parameter's partial gradient over the group in every backward pass
(Qwen3's per-head q/k norms under tensor parallelism).

`count_collectives()` records every collective that runs under it, whichever API issued it (`dist.all_reduce`,
DTensor's functional collectives, the backward pass), so tests and benchmarks can account for communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)  # the caller's tensor is left as it is
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient over `group` in backward."""
    if dist.get_world_size(group) == 1 or not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) over `group` forward; identity backward."""
    if dist.get_world_size(group) == 1:
        return x
    return _ReduceFrom.apply(x, group)


def sum_grad_over(param: torch.Tensor, group) -> None:
    """Sum `param`'s gradient over `group` in every backward pass, before it is accumulated into `param.grad` (so
    gradient accumulation adds summed gradients). Once per parameter object: call it again after loading replaced
    the parameter."""
    if getattr(param, "_grad_sum_group", None) is group:
        return

    def hook(grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=group)
        return grad

    param.register_hook(hook)
    param._grad_sum_group = group


@dataclass(frozen=True)
class Collective:
    """One collective call: its op name (e.g. "all_reduce"), the shape and the bytes of the tensor(s) it sent."""

    op: str
    shape: tuple[int, ...]
    bytes: int


# ops of the c10d and functional-collective namespaces that move no data of their own
_NOT_COMMUNICATION = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier"}
_OP_NAMES = {"allreduce_": "all_reduce", "broadcast_": "broadcast", "allgather_": "all_gather"}


def _tensors(arg):
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return []


class count_collectives(TorchDispatchMode):
    """Context manager recording the collectives issued under it, in order, in `.calls` (a list of `Collective`).

        with count_collectives() as comm:
            loss = model(**batch).loss
            comm.mark("backward")
            loss.backward()
        comm.calls  # [Collective("all_reduce", (T, H), T * H * 4), ...]; comm.marks["backward"] = index into calls
    """

    def __init__(self):
        super().__init__()
        self.calls: list[Collective] = []
        self.marks: dict[str, int] = {}

    def mark(self, name: str) -> None:
        self.marks[name] = len(self.calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func.name().partition("::")
        if namespace in ("c10d", "_c10d_functional") and name.split(".")[0] not in _NOT_COMMUNICATION:
            op = name.split(".")[0]
            tensors = _tensors(args[0]) if args else []
            self.calls.append(
                Collective(
                    _OP_NAMES.get(op, op),
                    tuple(tensors[0].shape) if len(tensors) == 1 else tuple(t.numel() for t in tensors),
                    sum(t.numel() * t.element_size() for t in tensors),
                )
            )
        return func(*args, **(kwargs or {}))


def sum_over(group=None):
    """A function that returns the sum of a tensor over the processes of `group` (the default group when None),
    leaving its argument as it was: one all-reduce per call, no autograd. The `reduce` of
    `hf_ppmoe.moe.balance.LoadBalancer.step` in a data-parallel loop of your own."""

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    return reduce
