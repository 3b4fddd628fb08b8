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
    # what the load-balancing loss counted: [E] float32 the routes of the gate's `assignment` per expert, each its
    # share of a token (real tokens only, before capacity), and the number of real tokens (a scalar); their ratio is
    # the loss's fraction c_e/S over the whole input. Summed over a step's inputs for the "global_batch" loss scope.
    assigned_per_expert: torch.Tensor | None = None
    num_tokens: torch.Tensor | None = None

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


def capacity_in_mode(
    capacity_factor: float | None, eval_capacity_factor: float | None, training: bool, top_k: int, group_size: int,
    num_experts: int,
) -> int | None:
    """The capacity a gate applies: `capacity_factor` in training, `eval_capacity_factor` in evaluation
    (`capacity_for`). The one place this choice is written."""
    return capacity_for(capacity_factor if training else eval_capacity_factor, top_k, group_size, num_experts)


def positions_in_expert(expert_ids: torch.Tensor, num_experts: int, group_size: int) -> torch.Tensor:
    """Position of every route in its expert's buffer, counted per group.

    Priority follows GShard Algorithm 1: within a group, all first routes (k=0) in token order fill the buffers
    before any second route (k=1) does, and so on. Sentinel routes take no slot (their position is meaningless).
    Counted by one stable sort of (group, expert) keys in that priority order: O(T*K) memory whatever E is (no
    [T, K, E] one-hot), no host read.

    expert_ids: [T, K] -> positions [T, K] (int64)
    """
    T, K = expert_ids.shape
    S = group_size
    G = math.ceil(T / S)
    ids = expert_ids if G * S == T else torch.nn.functional.pad(expert_ids, (0, 0, 0, G * S - T), value=num_experts)
    # [G*S, K] -> [G, K, S]: k-major order inside each group; key = group * (E + 1) + expert
    group = torch.arange(G, device=ids.device).view(G, 1, 1) * (num_experts + 1)
    keys = (ids.view(G, S, K).transpose(1, 2) + group).reshape(-1)
    sorted_keys, order = torch.sort(keys, stable=True)
    # rank among the routes before it with the same key: its sorted index minus the first index of its key
    rank = torch.arange(keys.numel(), device=ids.device) - torch.searchsorted(sorted_keys, sorted_keys)
    positions = torch.empty_like(rank).scatter_(0, order, rank)
    return positions.view(G, K, S).transpose(1, 2).reshape(G * S, K)[:T]
