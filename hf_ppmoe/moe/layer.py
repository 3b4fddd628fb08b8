"""`MoELayer` = gate, then experts (then the optional shared expert): a drop-in replacement for a dense FFN.

    hidden_states [B, S, H] ──flatten──> x [T, H]
        gate(x, token_mask)               ──> Routing: expert_ids [T, K], weights [T, K], router logits, losses
        experts(x, expert_ids, weights)   ──> [T, H]: each token's sum_k w_k * expert_{id_k}(x)
        + shared_expert(x)                    (when the config has one)
    output [B, S, H], Routing

The experts take Transformers' experts contract, `forward(hidden_states, top_k_index, top_k_weights) -> [T, H]`.
A parallel layout wraps the experts with that same contract (hf_ppmoe.parallel.expert_parallel: PPMoE's index slice
and one all-reduce, Transformers' all-to-all), so this forward reads the same on one device and on many.

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
    `router_type`, the experts' kernel its `experts_implementation`."""

    def __init__(self, config):
        super().__init__()
        self.gate = get_gate_class(config.router_type)(config)
        self.experts = Experts(config)
        shared = config.shared_expert_intermediate_size
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
        routing = self.gate(
            x, token_mask, compute_losses=compute_losses, expert_ids=expert_ids, sequence_length=sequence_length
        )
        out = self.experts(x, routing.expert_ids, routing.weights.to(x.dtype))
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.view(shape), routing
