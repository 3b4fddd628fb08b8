"""Gates: the `Gate` base class, its registry, and the built-in gates.

Legend: T tokens, H hidden, E experts, K routes per token, Z prototypes, F experts per prototype, S group size.

A gate reads any config object with the attributes below (our model configs have them all) and maps hidden states
`[T, H]` to a `Routing`. Subclasses implement `select`, which only chooses routes; the base class applies padding,
capacity, losses and statistics the same way for every gate, so a gate of your own is a few lines:

    @register_gate("my_gate")
    class MyGate(Gate):
        def select(self, logits):   # logits [T, E]: softmax them with dtype=torch.float32
            ...                     # -> expert_ids [T, K], weights [T, K], probs [T, E]

and, when the load-balancing loss should count routes other than "1/K for each route", `assignment`.

Config attributes read: `hidden_size`, `num_experts`, `num_experts_per_tok`, `capacity_factor`,
`eval_capacity_factor`, `router_num_groups`, `router_jitter_noise`, `router_dtype` (optional), and per gate
`router_random_routing` and `router_random_routing_takes_capacity` (gshard), `norm_topk_prob` and `topk_weighting`
(topk).

Randomness (jitter, GShard random routing) only happens in training and draws from `self.generator` when one is
set (else the default generator), so tensor-parallel ranks that share a seed draw the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .losses import balance_loss, losses_wanted, route_counts, route_fractions, router_z_loss
from .routing import Routing, capacity_for, group_size_for, positions_in_expert

GATES: dict[str, type[Gate]] = {}


def register_gate(name: str):
    """Class decorator adding a `Gate` subclass to the registry under `name` (the config's `router_type`)."""

    def decorator(cls):
        if not (isinstance(cls, type) and issubclass(cls, Gate)):
            raise TypeError(f"register_gate({name!r}) expects a subclass of hf_ppmoe.moe.Gate, got {cls!r}")
        GATES[name] = cls
        cls.router_type = name
        return cls

    return decorator


def get_gate_class(name: str) -> type[Gate]:
    """The gate class registered as `name`; ValueError listing the known ones otherwise."""
    if name not in GATES:
        raise ValueError(
            f"Unknown router_type {name!r}. Known gates: {', '.join(sorted(GATES))}. "
            "Register your own with @hf_ppmoe.moe.register_gate(name)."
        )
    return GATES[name]


class Gate(nn.Module):
    """Router weight `[E, H]` + route selection. Output: a `Routing` (see routing.py)."""

    router_type = "base"

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.capacity_factor = config.capacity_factor
        self.eval_capacity_factor = config.eval_capacity_factor
        self.num_groups = config.router_num_groups
        self.jitter_noise = config.router_jitter_noise
        self.float32_router = getattr(config, "router_dtype", None) == "float32"
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=getattr(config, "initializer_range", 0.02))
        self.generator: torch.Generator | None = None

    def extra_repr(self) -> str:
        return (
            f"router_type={self.router_type!r}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"capacity_factor={self.capacity_factor}, eval_capacity_factor={self.eval_capacity_factor}, "
            f"num_groups={self.num_groups}, jitter_noise={self.jitter_noise}"
        )

    @classmethod
    def check_config(cls, config) -> None:
        """Raise ValueError for settings this gate cannot work with (called when a model config is built)."""

    def select(self, logits: torch.Tensor):
        """logits [T, E] in the activations' dtype -> expert_ids [T, K] (sentinel E for a route not taken),
        weights [T, K] and probs [T, E] (for the load-balancing loss), both float32: take the softmax with
        `dtype=torch.float32`."""
        raise NotImplementedError

    def assignment(self, expert_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        """expert_ids [T, K] as `select` chose them (before padding and capacity) -> (the routes counted in the c_e
        of the load-balancing loss [T, R], each one's share of its token): by default every route, 1/K each (a
        sentinel route counts for nothing). Only computed with the losses."""
        return expert_ids, 1.0 / expert_ids.shape[1]

    def capacity_claims(self, logits: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """[T, K] the expert slot each route claims in the capacity count (sentinel: none), before padding is
        removed: by default the routes `select` took."""
        return expert_ids

    def load_balancing_loss(self, probs, fraction, token_mask, group_size):
        """The aux loss (GShard's, `losses.balance_loss`) from probs [T, E] and the routed fraction [G, E] of each
        group's tokens per expert; a gate may average it over its own groups of experts."""
        return balance_loss(probs, fraction, token_mask, group_size)

    def z_loss(self, logits, token_mask):
        """The router z-loss (`losses.router_z_loss`) of logits [T, E]."""
        return router_z_loss(logits, token_mask)

    def _uniform(self, shape, device) -> torch.Tensor:
        return torch.rand(shape, device=device, generator=self.generator)

    def forward(
        self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None = None, *, compute_losses: bool | None = None
    ) -> Routing:
        """hidden_states [T, H], token_mask [T] (False for padding) -> Routing. The losses and statistics are
        computed when `compute_losses` says so, by default when gradients are on (`losses.losses_wanted`)."""
        T, E = hidden_states.shape[0], self.num_experts
        x = hidden_states
        if self.training and self.jitter_noise > 0:
            # multiplicative jitter (Switch Transformer) on a copy: the caller's tensor is never modified
            x = x * (1.0 - self.jitter_noise + 2.0 * self.jitter_noise * self._uniform(x.shape, x.device))
        # the router GEMM in the activations' dtype (as Transformers' MoE blocks) unless the config asks for float32;
        # select() takes a float32 softmax either way
        dtype = torch.float32 if self.float32_router else x.dtype
        logits = F.linear(x.to(dtype), self.weight.to(dtype))  # [T, E]
        expert_ids, weights, probs = self.select(logits)
        selected = expert_ids
        if token_mask is not None:
            padding = ~token_mask.view(T, 1)
            expert_ids = expert_ids.masked_fill(padding, E)
            weights = weights.masked_fill(padding, 0.0)
        chosen = expert_ids

        group_size = group_size_for(T, self.num_groups)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        capacity = capacity_for(factor, expert_ids.shape[1], group_size, E)
        if capacity is not None:
            # overflowed routes are dropped: the token passes through the residual connection only
            claims = self.capacity_claims(logits, expert_ids)
            if token_mask is not None:
                claims = claims.masked_fill(padding, E)
            keep = (expert_ids < E) & (positions_in_expert(claims, E, group_size) < capacity)
            expert_ids = expert_ids.masked_fill(~keep, E)
            weights = weights.masked_fill(~keep, 0.0)

        if not losses_wanted(compute_losses):
            return Routing(expert_ids, weights, logits, E, group_size, capacity)
        with torch.no_grad():  # routes each expert received (real tokens, after capacity): counted, not one-hot
            received = route_counts(expert_ids.reshape(-1), E + 1, torch.float32)
            if capacity is None and token_mask is None:
                dropped_fraction = torch.zeros((), device=x.device)
            else:
                num_chosen = (chosen < E).sum()
                dropped_fraction = (num_chosen - received[:E].sum()) / num_chosen.clamp(min=1)
        routes, share = self.assignment(selected)
        if routes is expert_ids and group_size >= T:  # every route counted, none dropped or padded, one group
            fraction = (received[:E] * (share / T)).unsqueeze(0)
        else:
            fraction = route_fractions(routes, share, token_mask, E, group_size)
        aux_loss = self.load_balancing_loss(probs, fraction, token_mask, group_size)
        z_loss = self.z_loss(logits, token_mask)
        return Routing(
            expert_ids, weights, logits, E, group_size, capacity, aux_loss, z_loss, received[:E], dropped_fraction
        )


@register_gate("switch")
class SwitchGate(Gate):
    """Switch Transformer top-1: the token goes to its most probable expert, weighted by that probability."""

    @classmethod
    def check_config(cls, config):
        if config.num_experts_per_tok != 1:
            raise ValueError(
                f"router_type='switch' routes each token to 1 expert, but num_experts_per_tok="
                f"{config.num_experts_per_tok}. Set num_experts_per_tok=1, or use router_type='topk'."
            )

    def select(self, logits):
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weight, expert = probs.max(dim=-1, keepdim=True)
        return expert, weight, probs


@register_gate("topk")
class TopKGate(Gate):
    """Top-k of the softmax over all experts (Mixtral style), optionally renormalised to sum to one."""

    def __init__(self, config):
        super().__init__(config)
        self.normalize = config.norm_topk_prob
        self.weighting = getattr(config, "topk_weighting", "probs")

    def select(self, logits):
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.weighting == "m6t":  # M6-T Eq. (1): p = softmax(g), g = topk(softmax(W x))
            weights = weights.softmax(dim=-1)
        elif self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights, probs


@register_gate("gshard")
class GShardGate(Gate):
    """GShard Algorithm 1: group-level top-2 gating.

    g1, g2 are the top-2 softmax gates, normalised by g1 + g2. In training the second expert is used only with
    probability min(1, 2 * g2) (random routing). Capacity per group (base class) fills every token's first route
    before any second route. The aux loss counts first choices only: c_e = tokens whose top-1 is e, taken before
    capacity as in the authors' Lingvo implementation, so it reads "the fraction of input routed to each expert".
    """

    def __init__(self, config):
        super().__init__(config)
        self.random_routing = config.router_random_routing
        self.skipped_routes_take_capacity = getattr(config, "router_random_routing_takes_capacity", False)

    @classmethod
    def check_config(cls, config):
        if config.num_experts_per_tok != 2:
            raise ValueError(
                f"router_type='gshard' is GShard's top-2 gating, but num_experts_per_tok={config.num_experts_per_tok}. "
                "Set num_experts_per_tok=2, or use router_type='topk' for other k."
            )

    def select(self, logits):
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        gates, experts = probs.topk(2, dim=-1)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        if self.training and self.random_routing:
            # dispatch to the second-best expert with probability 2 * g2 (Algorithm 1, lines 19-21)
            skip = 2.0 * gates[:, 1] <= self._uniform(gates.shape[0], gates.device)
            experts = experts.clone()
            experts[:, 1] = experts[:, 1].masked_fill(skip, self.num_experts)
            gates = torch.stack([gates[:, 0], gates[:, 1].masked_fill(skip, 0.0)], dim=1)
        return experts, gates, probs

    def capacity_claims(self, logits, expert_ids):
        # Algorithm 1 line 24 read literally: c_e2 <- c + 1 comes after the `if`, so a second route that random routing
        # skipped still takes its slot in e2's buffer (the top-2 of the same softmax select() ranked)
        if self.training and self.random_routing and self.skipped_routes_take_capacity:
            return logits.softmax(dim=-1, dtype=torch.float32).topk(2, dim=-1).indices
        return expert_ids

    def assignment(self, expert_ids):
        # first choices only, as the class docstring says
        return expert_ids[:, :1], 1.0


@register_gate("prototype")
class PrototypeGate(Gate):
    """M6-T expert prototyping, "k top-1": the E experts are split into k = num_experts_per_tok prototypes of
    F = E / k experts; each prototype has its own softmax over its F experts and routes top-1, and the k outputs are
    summed: y = sum_i p_i E_i(x). Aux and z losses are computed per prototype (F^2 scaling) and averaged."""

    def __init__(self, config):
        super().__init__(config)
        self.num_prototypes = self.top_k
        self.experts_per_prototype = self.num_experts // self.top_k

    @classmethod
    def check_config(cls, config):
        if config.num_experts % config.num_experts_per_tok != 0:
            raise ValueError(
                f"router_type='prototype' splits num_experts={config.num_experts} into num_experts_per_tok="
                f"{config.num_experts_per_tok} prototypes, which must divide it evenly. Choose num_experts_per_tok "
                "among the divisors of num_experts."
            )

    def select(self, logits):
        T, Z, Fp = logits.shape[0], self.num_prototypes, self.experts_per_prototype
        probs = logits.view(T, Z, Fp).softmax(dim=-1, dtype=torch.float32)  # one softmax per prototype
        weights, local = probs.max(dim=-1)  # [T, Z]
        experts = local + torch.arange(Z, device=logits.device) * Fp
        return experts, weights, probs.view(T, Z * Fp)

    def assignment(self, expert_ids):
        # one route per prototype, each a whole token's choice within its prototype's experts
        return expert_ids, 1.0

    def load_balancing_loss(self, probs, fraction, token_mask, group_size):
        # per prototype over its F experts (F^2 scaling), then averaged; fraction [G, Z*F] counts a token once per
        # prototype, so each prototype's block sums to one
        T, Z, Fp = probs.shape[0], self.num_prototypes, self.experts_per_prototype
        probs, fraction = probs.view(T, Z, Fp).transpose(0, 1), fraction.view(-1, Z, Fp).transpose(0, 1)
        return torch.stack([balance_loss(probs[z], fraction[z], token_mask, group_size) for z in range(Z)]).mean()

    def z_loss(self, logits, token_mask):
        return router_z_loss(logits.view(logits.shape[0], self.num_prototypes, -1), token_mask)
