"""How routing is observed: one object, the `Routing` an `MoELayer` returns (`forward` -> `(output, Routing)`, the
Routing at `ROUTING_INDEX`), read in two ways and nowhere else.

- In the model's output: Transformers' output recorder (`capture_outputs`, set up by
  `hf_ppmoe.modeling.blocks.output_recorders`) records every MoE layer's Routing at `ROUTING_INDEX` when a forward is
  given `output_router_logits=True`, and the model returns its `router_logits` / `router_expert_ids`. This is
  Transformers' API for what a forward returns.
- Outside the forward: `RoutingHooks(module, on_routing)` puts a forward hook on every `MoELayer` under `module` and
  hands each call's `(layer name, Routing)` to `on_routing`; names are `module.named_modules()`'s. It asks the model
  for nothing (no output flag, no extra computation), so it serves observers that watch forwards the model runs for
  another purpose. Its consumers: `generate(output_router_logits=True)`'s per-step router statistics
  (`hf_ppmoe.generation.router_stats.RoutingRecorder`) and the training statistics of expert load and dropped routes
  (`hf_ppmoe.training.tracking.RouterMonitor`: `python -m hf_ppmoe.training`, the Trainer mixin, the quality
  benchmark). Neither puts hooks of its own on the MoE layers.

Both read the same Routing object the layer returns, so an observer outside the forward and the model output agree
by construction (a test checks that the callback gets the very tensors the model output holds).

What this module does not cover: the losses. The Trainer mixin's `LossMonitor` (`hf_ppmoe.training.trainer`) reads
the model's output fields (`lm_loss`, `num_target_tokens`, `aux_loss`, `z_loss`) with a forward hook on the model
Trainer calls. Those are what the model computed from all layers' Routings and from the forward's arguments (the
labels, `num_items_in_batch`), so they are observed where the model returns them, not rebuilt here from each layer's
`aux_loss` / `z_loss` (that would repeat the model's weighting of the layers and stacks,
`hf_ppmoe.modeling.blocks.combine_router_losses`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .layer import MoELayer
from .routing import Routing

# `MoELayer.forward` returns (output, Routing): where every observer, Transformers' recorder included, finds it
ROUTING_INDEX = 1


class RoutingHooks:
    """Forward hooks on every `MoELayer` under `module`: each forward of one calls `on_routing(name, routing)` with the
    layer's name in `module.named_modules()` and the `Routing` it returned. `remove()` (or leaving a `with` block)
    takes the hooks off; `keep_only` forgets the layers a pipeline stage does not hold."""

    def __init__(self, module: torch.nn.Module, on_routing: Callable[[str, Routing], None]):
        self.on_routing = on_routing
        self.layers: dict[str, MoELayer] = {name: m for name, m in module.named_modules() if isinstance(m, MoELayer)}
        self._handles = {name: layer.register_forward_hook(self._hook(name)) for name, layer in self.layers.items()}

    def _hook(self, name: str):
        def hook(layer, args, output):
            self.on_routing(name, output[ROUTING_INDEX])

        return hook

    def keep_only(self, module: torch.nn.Module) -> None:
        """Forget the layers `module` does not hold (a pipeline stage cut from the model): their hooks are removed, and
        the names of the others stay those of the module the hooks were built on."""
        held = {id(m) for m in module.modules()}
        for name in [n for n, m in self.layers.items() if id(m) not in held]:
            self._handles.pop(name).remove()
            del self.layers[name]

    def remove(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self.layers.clear()

    def __enter__(self) -> RoutingHooks:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
