"""What a parallelized model's modules become, so that `print(model)` shows what runs.

A plan style installs its communication on a module in place; the module then also takes a subclass of its own
class that says so, as torch's FSDP2 turns a `Linear` into an `FSDPLinear`:

    (q_proj): TensorParallelLinear(in_features=32, out_features=32, bias=False, style='colwise', group_size=2, rank=0)
    (mlp): TensorParallelMoELayer(
      style='ppmoe_ffn', group_size=2, rank=1
      (gate): TopKGate(router_type='topk', num_experts=4, top_k=2, ...)
      (experts): ExpertParallelExperts(num_experts=2, ..., style='ppmoe', group_size=2, rank=1, experts=[2, 4) of 4)

State dict keys, parameters and `isinstance` checks stay those of the original class.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


class ParallelModule:
    """Mixin of the classes below: the plan style applied to the module and the group it runs over."""

    parallel_style: str
    mesh: DeviceMesh

    def parallel_repr(self) -> str:
        return f"style={self.parallel_style!r}, group_size={self.mesh.size()}, rank={self.mesh.get_local_rank()}"

    def extra_repr(self) -> str:
        return ", ".join(filter(None, [super().extra_repr(), self.parallel_repr()]))


class TensorParallel(ParallelModule):
    """A module split or hooked by a tensor-parallel plan style."""


class ExpertParallel(ParallelModule):
    """An experts module holding `num_experts` consecutive experts from `first_expert` of the layer's
    `num_global_experts`, reached through the expert-parallel implementation `parallel_style`."""

    first_expert: int
    num_global_experts: int

    def parallel_repr(self) -> str:
        last = self.first_expert + self.num_global_experts // self.mesh.size()
        return f"{super().parallel_repr()}, experts=[{self.first_expert}, {last}) of {self.num_global_experts}"


_CLASSES: dict[tuple[type, type], type] = {}


def become(module: nn.Module, kind: type[ParallelModule], style: str, mesh: DeviceMesh, **attributes) -> nn.Module:
    """Give `module` the subclass `kind` + its class (made once per pair, e.g. `TensorParallelLinear`) and the
    attributes `kind` reads."""
    cls = type(module)
    if not isinstance(module, kind):
        if (kind, cls) not in _CLASSES:
            _CLASSES[kind, cls] = type(f"{kind.__name__}{cls.__name__}", (kind, cls), {"__module__": cls.__module__})
        module.__class__ = _CLASSES[kind, cls]
    module.parallel_style, module.mesh = style, mesh
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


def show_plan(model: nn.Module, plan: dict[str, str], mesh: DeviceMesh) -> None:
    """Label every module a resolved tensor-parallel `plan` hooked, unless its style already made it a
    `ParallelModule` (an MoE layer, experts)."""
    modules = dict(model.named_modules())
    for name, style in plan.items():
        module = modules.get(name)
        if module is not None and not isinstance(module, ParallelModule):
            become(module, TensorParallel, style, mesh)
