"""Balancing done once per optimizer step, from the routes of the whole step: aux-loss-free bias balancing
(DeepSeek-V3, arXiv 2408.15664) and the fraction of the "global_batch" load-balancing loss (Qwen, arXiv 2501.11873).

Legend: L MoE layers that need it, E experts.

    balancer = LoadBalancer(model)            # hooks the MoE layers whose gates hold `expert_bias` / `global_fraction`
    for step in ...:
        for micro_batch in ...:
            model(**micro_batch).loss.backward()
        optimizer.step()
        balancer.step()                         # one process
        balancer.step(reduce=sum_over(group))   # data parallel: hf_ppmoe.parallel.sum_over, one all-reduce per step

or `balancer.step_with(optimizer, reduce)` once, to step after every `optimizer.step()` by itself.

`step` sums the counts of every training forward since the last step (all micro-batches; `reduce` adds those of the
other data-parallel processes, in ONE collective for all layers), then per layer:
- `expert_bias += rate * sign(mean_e load - load)`, the update centred to mean zero (so a bias that starts at zero
  stays centred; adding a constant to every expert's bias would change no choice). The load is the routes each expert
  received (`Routing.tokens_per_expert`: real tokens, after capacity), as in Megatron-core.
- `global_fraction = assigned / tokens`: the share of the routes each expert got (what the balance loss counts,
  `Routing.assigned_per_expert`) over the step's global batch, which the next step's loss uses.
Both depend on the counts only, summed exactly (integers in float32), so a 2-process run updates them as one process
over the same global batch does. A forward counts when its layer is in training mode and computed its statistics.
Gradient checkpointing runs a layer's forward again in the backward: every count doubles alike, which changes neither
the signs nor the fractions.

No collective is called here: it comes from outside as `reduce` (a function summing a tensor over the
data-parallel processes), as hf_ppmoe.moe never communicates.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .layer import MoELayer
from .observe import RoutingHooks
from .routing import Routing


def bias_update(load: torch.Tensor, rate: float) -> torch.Tensor:
    """load [..., E] routes per expert -> the bias change [..., E]: `rate * sign(mean - load)` (an overloaded expert's
    bias goes down, an underloaded one's up), centred to mean zero over the experts."""
    delta = rate * torch.sign(load.mean(dim=-1, keepdim=True) - load)
    return delta - delta.mean(dim=-1, keepdim=True)


def needs_balancing(layer: MoELayer) -> bool:
    """Whether the layer's gate has per-step state: an expert bias or a global-batch loss fraction."""
    return layer.gate.expert_bias is not None or layer.gate.global_fraction is not None


class LoadBalancer:
    """Counts the routes of every training forward of `model`'s MoE layers that need it (`needs_balancing`) and, at
    `step()`, updates their gates' `expert_bias` and `global_fraction` (module docstring). `rate` defaults to the
    model config's `router_bias_update_rate`. `layers` is empty when no layer needs it (then `step` does nothing and
    communicates nothing). Also a checkpointable object (`state_dict` / `load_state_dict`: the global fractions,
    which are training state and not saved with the model, and the counts not yet used)."""

    def __init__(self, model: torch.nn.Module, rate: float | None = None):
        self.rate = rate if rate is not None else model.config.router_bias_update_rate
        self.hooks = RoutingHooks(model, self._add)
        self.layers: dict[str, MoELayer] = {n: layer for n, layer in self.hooks.layers.items() if needs_balancing(layer)}
        self.counts: dict[str, torch.Tensor] = {}  # per layer [2E + 1]: received, assigned, tokens (global-batch only)

    def keep_only(self, module: torch.nn.Module) -> None:
        """Forget the layers `module` does not hold (a pipeline stage)."""
        self.hooks.keep_only(module)
        self.layers = {n: layer for n, layer in self.layers.items() if n in self.hooks.layers}

    def _add(self, name: str, routing: Routing) -> None:
        layer = self.layers.get(name)
        if layer is None or routing.tokens_per_expert is None or not layer.training:
            return
        E = layer.gate.num_experts
        with torch.no_grad():
            if name not in self.counts:
                self.counts[name] = torch.zeros(2 * E + 1, dtype=torch.float32, device=routing.tokens_per_expert.device)
            counts = self.counts[name]
            counts[:E] += routing.tokens_per_expert
            if routing.assigned_per_expert is not None:  # counted by the "global_batch" loss scope only
                counts[E : 2 * E] += routing.assigned_per_expert
                counts[2 * E] += routing.num_tokens

    def pending(self) -> torch.Tensor:
        """[L, 2E + 1] this process's counts since the last step, every layer in `layers` order (zeros for a layer
        that ran no training forward, so every process holds the same shape)."""
        rows = []
        for name, layer in self.layers.items():
            E = layer.gate.num_experts
            rows.append(self.counts.get(name, torch.zeros(2 * E + 1, device=layer.gate.weight.device)).float())
        return torch.stack(rows)

    @torch.no_grad()
    def step(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | None:
        """After the optimizer step: update every layer's bias and global fraction from the step's counts, summed over
        processes by `reduce` (one call). Returns the summed counts [L, 2E + 1] (None without layers)."""
        if not self.layers:
            return None
        counts = self.pending()
        if reduce is not None:
            counts = reduce(counts)
        self.counts = {}
        for row, layer in zip(counts, self.layers.values()):
            gate, E = layer.gate, layer.gate.num_experts
            received, assigned, tokens = row[:E], row[E : 2 * E], row[2 * E]
            # a layer no forward reached (no tokens) keeps its state: no load moves no bias (sign(0) = 0), and its
            # fraction stays; no host read
            if gate.expert_bias is not None:
                delta = bias_update(received.to(gate.expert_bias.device), self.rate)
                gate.expert_bias.add_(delta.to(gate.expert_bias.dtype))
            if gate.global_fraction is not None:
                fraction = torch.where(tokens > 0, assigned / tokens.clamp(min=1), gate.global_fraction.to(assigned.device))
                gate.global_fraction.copy_(fraction)
        return counts

    def step_with(self, optimizer: torch.optim.Optimizer, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """Run `step(reduce)` after every `optimizer.step()` (a post-step hook on that optimizer): the plain-loop
        helper that needs no line in the loop. Returns the hook's handle (`.remove()` stops it)."""
        return optimizer.register_step_post_hook(lambda *_: self.step(reduce))

    def state_dict(self) -> dict:
        state = {f"{name}.global_fraction": layer.gate.global_fraction for name, layer in self.layers.items()
                 if layer.gate.global_fraction is not None}
        state.update({f"{name}.counts": counts for name, counts in self.counts.items()})
        return state

    def load_state_dict(self, state: dict) -> None:
        for name, layer in self.layers.items():
            if (fraction := state.get(f"{name}.global_fraction")) is not None and layer.gate.global_fraction is not None:
                layer.gate.global_fraction.copy_(fraction)
        self.counts = {key.removesuffix(".counts"): value for key, value in state.items() if key.endswith(".counts")}

    def remove(self) -> None:
        self.hooks.remove()
