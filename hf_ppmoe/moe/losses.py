"""Router losses as pure functions. Padding tokens (token_mask False) never count.

Legend: T tokens, E experts, S tokens per group.
"""

from __future__ import annotations

import math

import torch


def losses_wanted(requested: bool | None, *, labels: bool = False, router_logits: bool = False) -> bool:
    """Whether the router losses and statistics are computed: as requested; by default when there are labels (the
    loss includes them), when router logits are asked for, or when gradients are on. The one place this default is
    decided; callers pass what they know."""
    if requested is not None:
        return bool(requested)
    return labels or router_logits or torch.is_grad_enabled()


def mean_over_layers(parts, num_layers: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(aux_loss, z_loss) averaged over `num_layers` MoE layers, from `parts`: (aux, z, n) triples, each the mean over
    n of those layers (one layer, a stack, a pipeline stage's share; aux None: no losses there). The one form of this
    mean, so a coefficient means the same however the layers are split into stacks or stages. The results are
    tensors of their own, not views (FSDP2 warns about views a wrapped model returns)."""
    parts = [(aux, z, n) for aux, z, n in parts if aux is not None and n > 0]
    if not parts:
        return None, None
    aux = sum(a * (n / num_layers) for a, _, n in parts)
    z = sum(z * (n / num_layers) for _, z, n in parts)
    return aux, z


def route_counts(ids: torch.Tensor, bins: int, dtype: torch.dtype, weights: torch.Tensor | None = None) -> torch.Tensor:
    """[bins] how many of `ids` (or the sum of their `weights`) fall in each bin: one accumulating index_put (no
    one-hot tensor, no host read, a static shape)."""
    values = torch.ones((), dtype=dtype, device=ids.device) if weights is None else weights.to(dtype)
    return torch.zeros(bins, dtype=dtype, device=ids.device).index_put_((ids,), values, accumulate=True)


def _group_tokens(token_mask: torch.Tensor | None, T: int, S: int):
    """Real tokens per group [G] (a Python number when every group is full and there is no padding)."""
    G = math.ceil(T / S)
    if token_mask is None:
        return S if G * S == T else (T - S * torch.arange(G, dtype=torch.float32)).clamp(max=S)
    w = torch.nn.functional.pad(token_mask.float(), (0, G * S - T))
    return w.view(G, S).sum(dim=1)


def route_fractions(
    routes: torch.Tensor, share: float, token_mask: torch.Tensor | None, num_experts: int, group_size: int
) -> torch.Tensor:
    """c_e / S of the load-balancing loss: [G, E] the share of each group's real tokens routed to each expert, from
    routes [T, R] (the gate's `assignment`; sentinel id E counts for nothing) that each carry `share` of a token."""
    T, R = routes.shape
    S, bins = group_size, num_experts + 1
    G = math.ceil(T / S)
    index = routes
    if G > 1:
        index = routes + (torch.arange(T, device=routes.device) // S * bins).unsqueeze(-1)
    weights = None if token_mask is None else token_mask.unsqueeze(-1).expand(T, R).reshape(-1)
    counts = route_counts(index.reshape(-1), G * bins, torch.float32, weights).view(G, bins)[:, :num_experts]
    tokens = _group_tokens(token_mask, T, S)
    tokens = tokens.to(counts.device).clamp(min=1).unsqueeze(-1) if torch.is_tensor(tokens) else tokens
    return counts * (share / tokens)


def balance_loss(
    probs: torch.Tensor, fraction: torch.Tensor, token_mask: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """GShard's auxiliary loss, per group then averaged over the groups that hold real tokens:

        aux = E^2 * mean_e( c_e/S * m_e )      (= E * sum_e c_e/S * m_e; 1.0 when perfectly balanced)

    m_e is the mean router probability of expert e over the group's real tokens (the differentiable part) and c_e/S
    (`fraction` [G, E], `route_fractions`) the share of the group's tokens assigned to e (not differentiable).
    probs: [T, E] float32; token_mask: [T] bool (False for padding) or None.
    """
    T, E = probs.shape
    S = group_size
    G = math.ceil(T / S)
    if token_mask is None and G == 1:  # no padding, one group: a plain mean
        return torch.dot(fraction[0], probs.mean(dim=0)) * E
    w = torch.ones(T, device=probs.device) if token_mask is None else token_mask.to(probs.dtype)
    pad = G * S - T
    if pad:
        probs = torch.nn.functional.pad(probs, (0, 0, 0, pad))
        w = torch.nn.functional.pad(w, (0, pad))
    w = w.view(G, S, 1)
    tokens = w.sum(dim=1)  # [G, 1]
    mean_prob = (probs.reshape(G, S, E) * w).sum(dim=1) / tokens.clamp(min=1)  # m_e
    per_group = (fraction * mean_prob).sum(dim=-1) * E  # [G]
    # mean over the groups that hold real tokens (0 when none does), without a data-dependent shape
    has_tokens = (tokens.squeeze(-1) > 0).to(per_group.dtype)
    return (per_group * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def router_z_loss(logits: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over real tokens of logsumexp(logits)^2.

    logits: [T, E], or [T, R, E'] for R independent routers (each router's logsumexp is penalised, then averaged),
    in any dtype (computed in float32); token_mask: [T] bool or None (no padding).
    """
    lse = torch.logsumexp(logits.float(), dim=-1).square()
    if lse.dim() == 2:
        lse = lse.mean(dim=-1)
    if token_mask is None:
        return lse.mean()
    w = token_mask.to(lse.dtype)
    return (lse * w).sum() / w.sum().clamp(min=1)


def router_loss(config, aux_loss: torch.Tensor | None, z_loss: torch.Tensor | None):
    """The router term added to the LM loss: `router_aux_loss_coef * aux_loss + router_z_loss_coef * z_loss`.

    The one place this sum is written. A forward without router losses (aux_loss None) contributes 0.
    """
    if aux_loss is None:
        return 0.0
    total = config.router_aux_loss_coef * aux_loss
    if z_loss is not None:
        total = total + config.router_z_loss_coef * z_loss
    return total
