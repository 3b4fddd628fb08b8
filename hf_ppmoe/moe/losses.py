"""Router losses as pure functions. Padding tokens (token_mask False) never count.

Legend: T tokens, E experts, S tokens per group.
"""

from __future__ import annotations

import math

import torch


def load_balancing_loss(
    probs: torch.Tensor, assignment: torch.Tensor, token_mask: torch.Tensor, group_size: int
) -> torch.Tensor:
    """GShard's auxiliary loss, per group then averaged over groups:

        aux = E^2 * mean_e( c_e/S * m_e )      (= E * sum_e c_e/S * m_e; 1.0 when perfectly balanced)

    m_e is the mean router probability of expert e over the group's tokens (the differentiable part) and c_e/S the
    fraction of the group's tokens assigned to e (not differentiable).

    probs: [T, E] router probabilities; assignment: [T, E] each token's share of routes per expert (rows sum to 1);
    token_mask: [T] bool, False for padding.
    """
    T, E = probs.shape
    S = group_size
    G = math.ceil(T / S)
    w = token_mask.to(probs.dtype)
    pad = G * S - T
    if pad:
        probs = torch.nn.functional.pad(probs, (0, 0, 0, pad))
        assignment = torch.nn.functional.pad(assignment, (0, 0, 0, pad))
        w = torch.nn.functional.pad(w, (0, pad))
    w = w.view(G, S, 1)
    tokens = w.sum(dim=1)  # [G, 1]
    fraction = (assignment.view(G, S, E).to(probs.dtype) * w).sum(dim=1) / tokens.clamp(min=1)  # c_e / S
    mean_prob = (probs.view(G, S, E) * w).sum(dim=1) / tokens.clamp(min=1)  # m_e
    per_group = (fraction * mean_prob).mean(dim=-1) * E * E  # [G]
    # mean over the groups that hold real tokens (0 when none does), without a data-dependent shape
    has_tokens = (tokens.squeeze(-1) > 0).to(per_group.dtype)
    return (per_group * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def router_z_loss(logits: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over real tokens of logsumexp(logits)^2.

    logits: [T, E], or [T, R, E'] for R independent routers (each router's logsumexp is penalised, then averaged).
    """
    lse = torch.logsumexp(logits, dim=-1)
    if lse.dim() == 2:
        lse = lse.square().mean(dim=-1)
    else:
        lse = lse.square()
    w = token_mask.to(lse.dtype)
    return (lse * w).sum() / w.sum().clamp(min=1)


def router_loss(config, aux_loss: torch.Tensor | None, z_loss: torch.Tensor | None):
    """The router term added to the LM loss: `router_aux_loss_coef * aux_loss + router_z_loss_coef * z_loss`.

    The one place this sum is written. A config without the coefficients (a dense model) or a model without router
    losses (aux_loss None) contributes 0.
    """
    if aux_loss is None:
        return 0.0
    total = getattr(config, "router_aux_loss_coef", 0.0) * aux_loss
    if z_loss is not None:
        total = total + getattr(config, "router_z_loss_coef", 0.0) * z_loss
    return total
