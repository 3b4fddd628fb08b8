"""`MoELayer` = gate + experts (+ optional shared expert): a drop-in replacement for a dense FFN.

          hidden_states [B, S, H] ──flatten──> x [T, H]
                                                │
        dispatcher:  route: gate(x, token_mask) ──> Routing: expert_ids [T, K], weights [T, K], losses
                     dispatch ──> experts(x, expert_ids, weights)   (compute: sum_k w_k * expert_{id_k}(x))
                     combine ──> [T, H]                                          (+ shared_expert(x))
                                 output [B, S, H], Routing

A dropped route contributes nothing, so an overflowed token leaves the layer as zeros and passes through the
model's residual connection, as in GShard.
"""

from __future__ import annotations

import torch
from torch import nn

from .experts import MLP, Experts
from .gates import get_gate_class
from .routing import Routing


class TokenDispatcher(nn.Module):
    """How a layer's routed tokens reach its experts and come back, in the four steps a reader can follow:
    route (the gate) -> dispatch (what the experts receive) -> compute (the experts) -> combine (their output back to
    the layer's tokens). The experts' contract is Transformers' (`forward(hidden_states, top_k_index,
    top_k_weights)` -> [T, H]): they return each token's routing-weighted sum over its K routes, so combine has only
    the experts' placement to undo. This one keeps every step on this device (combine has nothing to bring back). A
    parallel layout puts its own in the layer's `dispatcher` slot, where `print(model)` shows it
    (hf_ppmoe.parallel.expert_parallel: PPMoE's dispatch into the tensor-parallel group and its one-all-reduce
    combine, and the all-to-all across data-parallel ranks)."""

    def forward(self, layer: MoELayer, x: torch.Tensor, token_mask: torch.Tensor | None, compute_losses: bool | None):
        routing = self.route(layer.gate, x, token_mask, compute_losses)
        out = layer.experts(*self.dispatch(x, routing, layer.experts))  # compute
        return self.combine(out, routing, layer.experts), routing

    def route(self, gate, x, token_mask, compute_losses) -> Routing:
        return gate(x, token_mask, compute_losses=compute_losses)

    def dispatch(self, x: torch.Tensor, routing: Routing, experts: nn.Module):
        """The experts' contract: (hidden_states [T, H], expert_ids [T, K], weights [T, K] in the hidden dtype)."""
        return x, routing.expert_ids, routing.weights.to(x.dtype)

    def combine(self, out: torch.Tensor, routing: Routing, experts: nn.Module) -> torch.Tensor:
        """The experts' output [T, H] as the layer's: here, as it is."""
        return out


class MoELayer(nn.Module):
    """Gate + experts (+ shared expert) for one FFN slot (see the module docstring); the gate is the config's
    `router_type`, the experts' kernel its `experts_implementation`, the path between them the `dispatcher`'s."""

    def __init__(self, config):
        super().__init__()
        self.gate = get_gate_class(config.router_type)(config)
        self.dispatcher = TokenDispatcher()
        self.experts = Experts(config)
        shared = getattr(config, "shared_expert_intermediate_size", 0)
        self.shared_expert = MLP(config, shared) if shared else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        compute_losses: bool | None = None,
        expert_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Routing]:
        """hidden_states [..., H], token_mask [...] (False for padding) -> (output [..., H], Routing).

        compute_losses: the router losses and statistics, by default with gradients (`losses.losses_wanted`).
        expert_ids [T, K] (T = the tokens of hidden_states): router replay, these routes instead of the gate's choice
        (the gate still computes their weights, which get gradients)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if token_mask is not None:
            token_mask = token_mask.reshape(-1).bool()
        sequence_length = shape[-2] if len(shape) > 2 else None
        with self.gate.given(expert_ids=expert_ids, sequence_length=sequence_length):
            out, routing = self.dispatcher(self, x, token_mask, compute_losses)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.view(shape), routing
