"""The `Routing` result: the contract between gates and experts.

Legend: T tokens, H hidden, E experts, K routes per token, G groups, S tokens per group, C capacity.

A gate turns hidden states `[T, H]` into a `Routing`. Experts consume only `(hidden_states, expert_ids, weights)`,
the same contract as Transformers' experts kernels (`transformers.integrations.moe`): a route that goes nowhere
(dropped by capacity, skipped by random routing, a padding token, or an expert on another rank) has weight 0 and
the sentinel id `num_experts`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class Routing(NamedTuple):
    """A gate's result. A `NamedTuple` (immutable: `routing._replace(aux_loss=...)` makes a changed copy) so that
    engines that walk a module's output find its tensors: DeepSpeed ZeRO-3 gathers the router weight again for the
    gate's backward through hooks on those tensors and looks inside tuples, lists and dicts only; torch's pytree
    (FSDP2, torch.compile) takes named tuples as they are."""

    expert_ids: torch.Tensor  # [T, K] int64; `num_experts` marks a route that goes nowhere
    weights: torch.Tensor  # [T, K] combine weights; 0 where expert_ids is the sentinel
    router_logits: torch.Tensor  # [T, E] before softmax, in the activations' dtype (the softmax is float32)
    num_experts: int
    group_size: int  # S: tokens per group for capacity (the whole batch when there is one group)
    capacity: int | None = None  # C: per-group expert capacity; None means dropless
    # losses and statistics; None when the gate was asked not to compute them (inference without gradients)
    aux_loss: torch.Tensor | None = None  # scalar load-balancing loss (padding excluded)
    z_loss: torch.Tensor | None = None  # scalar router z-loss (padding excluded)
    tokens_per_expert: torch.Tensor | None = None  # [E] float32: routes each expert received, real tokens only
    dropped_fraction: torch.Tensor | None = None  # scalar: routes chosen but dropped by capacity / routes chosen

    @property
    def top_k(self) -> int:
        """K: routes per token."""
        return self.expert_ids.shape[-1]


def group_size_for(num_tokens: int, num_groups: int) -> int:
    """Tokens per group when `num_tokens` are cut into `num_groups` contiguous groups (the last may be shorter)."""
    return max(1, math.ceil(num_tokens / num_groups))


def capacity_for(capacity_factor: float | None, top_k: int, group_size: int, num_experts: int) -> int | None:
    """GShard's per-group expert capacity C = capacity_factor * K * S / E (rounded up); None means dropless."""
    if capacity_factor is None:
        return None
    return max(1, math.ceil(capacity_factor * top_k * group_size / num_experts))


def positions_in_expert(expert_ids: torch.Tensor, num_experts: int, group_size: int) -> torch.Tensor:
    """Position of every route in its expert's buffer, counted per group.

    Priority follows GShard Algorithm 1: within a group, all first routes (k=0) in token order fill the buffers
    before any second route (k=1) does, and so on. Sentinel routes take no slot (their position is meaningless).

    expert_ids: [T, K] -> positions [T, K] (int64)
    """
    T, K = expert_ids.shape
    S = group_size
    G = math.ceil(T / S)
    one_hot = torch.nn.functional.one_hot(expert_ids, num_experts + 1)[..., :num_experts]  # [T, K, E]
    if G * S != T:
        one_hot = torch.nn.functional.pad(one_hot, (0, 0, 0, 0, 0, G * S - T))
    # [G, S, K, E] -> [G, K, S, E] -> [G, K*S, E]: k-major order inside each group
    one_hot_g = one_hot.view(G, S, K, num_experts).transpose(1, 2).reshape(G, K * S, num_experts)
    positions = one_hot_g.cumsum(dim=1) - 1
    positions = (positions * one_hot_g).sum(dim=-1)  # [G, K*S]
    positions = positions.view(G, K, S).transpose(1, 2).reshape(G * S, K)
    return positions[:T]
