"""`MoELayer` = gate + experts (+ optional shared expert): a drop-in replacement for a dense FFN.

          hidden_states [B, S, H] ──flatten──> x [T, H]
                                                │
                          ┌──── gate(x, token_mask) ────> Routing: expert_ids [T, K], weights [T, K], losses
                          │                     │
                          └──> experts(x, expert_ids, weights) ──> sum_k w_k * expert_{id_k}(x)   [T, H]
                                                │                          (+ shared_expert(x))
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


class MoELayer(nn.Module):
    """Gate + experts (+ shared expert) for one FFN slot (see the module docstring); the gate is the config's
    `router_type`, the experts' dispatch its `dispatch`."""
    def __init__(self, config):
        super().__init__()
        self.gate = get_gate_class(config.router_type)(config)
        self.experts = Experts(config)
        shared = getattr(config, "shared_expert_intermediate_size", 0)
        self.shared_expert = MLP(config, shared) if shared else None

    def forward(
        self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None = None, *, compute_losses: bool | None = None
    ) -> tuple[torch.Tensor, Routing]:
        """hidden_states [..., H], token_mask [...] (False for padding) -> (output [..., H], Routing).

        compute_losses: the router losses and statistics, by default with gradients (`losses.losses_wanted`)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if token_mask is not None:
            token_mask = token_mask.reshape(-1).bool()
        out, routing = self.route(x, token_mask, compute_losses)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.view(shape), routing

    def route(
        self, x: torch.Tensor, token_mask: torch.Tensor | None, compute_losses: bool | None
    ) -> tuple[torch.Tensor, Routing]:
        """Gate + routed experts: x [T, H] -> (their output [T, H], Routing). Expert parallelism
        (`hf_ppmoe.parallel.expert_parallel.PPMoELayer`) overrides this method, the part of the layer it splits over
        ranks."""
        routing = self.gate(x, token_mask, compute_losses=compute_losses)
        return self.experts(x, routing.expert_ids, routing.weights.to(x.dtype)), routing
