"""Gates: the `Gate` base class, its registry, and the built-in gates.

Legend: T tokens, H hidden, E experts, K routes per token, Z prototypes, F experts per prototype, S group size,
N expert groups (DeepSeek-V3's group-limited routing; not GShard's token groups, `router_num_groups`).

A gate reads any config object with the attributes below (our model configs have them all) and maps hidden states
`[T, H]` to a `Routing`, in the named steps of `Gate.forward` (Megatron-core's names where it has them):

    apply_input_jitter -> gating (the router GEMM) -> routing (select, or replay given ids) -> mask_padding
        -> apply_capacity -> statistics_and_losses

Subclasses implement `select`, which only chooses routes (and `replay`, the weights of routes given from outside);
the base class applies padding, capacity, losses and statistics the same way for every gate, so a gate of your own is
a few lines:

    @register_gate("my_gate")
    class MyGate(Gate):
        def select(self, logits):   # logits [T, E]: softmax them with dtype=torch.float32
            ...                     # -> expert_ids [T, K], weights [T, K], probs [T, E]

and, when the load-balancing loss should count routes other than "1/K for each route", `assignment`.

Config attributes read (their defaults are `hf_ppmoe.modeling.configuration_moe.MoEConfig`'s): `hidden_size`,
`initializer_range`, `num_experts`, `num_experts_per_tok`, `capacity_factor`, `eval_capacity_factor`,
`router_num_groups`, `router_jitter_noise`, `router_dtype`, `router_aux_loss_scope`, `router_expert_bias`, and per gate
`router_random_routing` and `router_random_routing_takes_capacity` (gshard), `norm_topk_prob`, `topk_weighting`,
`router_score_function`, `routed_scaling_factor`, `num_expert_groups` and `topk_expert_groups` (topk).

"Group" alone means GShard's token groups (`router_num_groups`: capacity and the aux loss are per group); DeepSeek's
groups of experts are always "expert groups".

Two buffers a gate may hold, neither a parameter: `expert_bias` [E] (with `router_expert_bias`: added to the scores
to choose experts, never to the weights; saved with the model) and `global_fraction` [E] (with
`router_aux_loss_scope="global_batch"`: the share of the routes each expert got over the last optimizer step's
global batch; training state). `hf_ppmoe.moe.balance.LoadBalancer` updates both after each optimizer step.

Randomness (jitter, GShard random routing) only happens in training and draws from `self.generator` when one is
set (else the default generator). A layout whose ranks route the same tokens (tensor parallelism) sets
`generator_seed` alike on every rank: the gate then makes its generator from it, on its input's device, at its first
draw, so those ranks draw the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .losses import balance_loss, losses_wanted, route_counts, route_fractions, router_z_loss
from .routing import Routing, capacity_in_mode, group_size_for, positions_in_expert

GATES: dict[str, type[Gate]] = {}
AUX_LOSS_SCOPES = ("micro_batch", "sequence", "global_batch")


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


def gather_routes(values: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """values [T, E] at expert_ids [T, K] -> [T, K]; 0 where the id is the sentinel E."""
    E = values.shape[-1]
    return values.gather(-1, expert_ids.clamp(max=E - 1)).masked_fill(expert_ids >= E, 0.0)


class Gate(nn.Module):
    """Router weight `[E, H]` + route selection. Output: a `Routing` (see routing.py)."""

    router_type = "base"
    supports_expert_bias = False  # whether `select` adds `expert_bias` to its scores (check_config refuses it otherwise)

    def __init__(self, config):
        super().__init__()
        self.num_experts = E = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.capacity_factor = config.capacity_factor
        self.eval_capacity_factor = config.eval_capacity_factor
        self.num_groups = config.router_num_groups
        self.jitter_noise = config.router_jitter_noise
        self.float32_router = config.router_dtype == "float32"
        self.aux_loss_scope = config.router_aux_loss_scope
        self.weight = nn.Parameter(torch.empty(E, config.hidden_size))
        self.initializer_range = config.initializer_range
        self.reset_parameters()
        bias = config.router_expert_bias
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32) if bias else None)
        scope = self.aux_loss_scope == "global_batch"
        self.register_buffer("global_fraction", torch.zeros(E, dtype=torch.float32) if scope else None, persistent=False)
        self.generator: torch.Generator | None = None
        self.generator_seed: int | None = None  # see the module docstring: randomness

    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) router weight: the one place it is written (the model's `_init_weights` calls
        it; Transformers' `init` functions skip a weight loaded from a checkpoint)."""
        init.normal_(self.weight, std=self.initializer_range)

    def extra_repr(self) -> str:
        return (
            f"router_type={self.router_type!r}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"capacity_factor={self.capacity_factor}, eval_capacity_factor={self.eval_capacity_factor}, "
            f"num_groups={self.num_groups}, jitter_noise={self.jitter_noise}, aux_loss_scope={self.aux_loss_scope!r}, "
            f"expert_bias={self.expert_bias is not None}"
        )

    @classmethod
    def check_config(cls, config) -> None:
        """Raise ValueError for settings this gate cannot work with (called when a model config is built)."""
        if config.router_expert_bias and not cls.supports_expert_bias:
            raise ValueError(
                f"router_expert_bias=True (aux-loss-free balancing) needs a gate that chooses experts by scores plus a "
                f"bias; router_type={cls.router_type!r} does not. Use router_type='topk' (softmax or sigmoid scores)."
            )

    # -- what a gate defines ----------------------------------------------------------------------------------------

    def select(self, logits: torch.Tensor):
        """logits [T, E] in the activations' dtype -> expert_ids [T, K] (sentinel E for a route not taken),
        weights [T, K] and probs [T, E] (for the load-balancing loss), both float32: take the softmax with
        `dtype=torch.float32`."""
        raise NotImplementedError

    def replay(self, logits: torch.Tensor, expert_ids: torch.Tensor):
        """Router replay: the routes are given (expert_ids [T, K], sentinel E allowed) -> (expert_ids, weights [T, K],
        probs [T, E]) with the weights `select` would give those experts, differentiable in the logits."""
        raise NotImplementedError(f"router_type={self.router_type!r} does not implement router replay (Gate.replay).")

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
        group's tokens per expert; a gate may average it over its own sets of experts (prototypes)."""
        return balance_loss(probs, fraction, token_mask, group_size)

    def z_loss(self, logits, token_mask):
        """The router z-loss (`losses.router_z_loss`) of logits [T, E]."""
        return router_z_loss(logits, token_mask)

    def _uniform(self, shape, device) -> torch.Tensor:
        if self.generator is None and self.generator_seed is not None:
            self.generator = torch.Generator(device).manual_seed(self.generator_seed)
        return torch.rand(shape, device=device, generator=self.generator)

    # -- the steps of forward -------------------------------------------------------------------------------------

    def apply_input_jitter(self, x: torch.Tensor) -> torch.Tensor:
        """Multiplicative jitter (Switch Transformer) in training, on a copy: the caller's tensor is never modified."""
        if self.training and self.jitter_noise > 0:
            return x * (1.0 - self.jitter_noise + 2.0 * self.jitter_noise * self._uniform(x.shape, x.device))
        return x

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> logits [T, E]: the router GEMM in the activations' dtype (as Transformers' MoE blocks) unless the
        config asks for float32; the scores are float32 either way."""
        dtype = torch.float32 if self.float32_router else x.dtype
        return F.linear(x.to(dtype), self.weight.to(dtype))

    def routing(self, logits: torch.Tensor, expert_ids: torch.Tensor | None = None):
        """The routes (`select`), or the given ones with their weights (`replay`) -> (expert_ids, weights, probs)."""
        if expert_ids is None:
            return self.select(logits)
        return self.replay(logits, expert_ids.reshape(logits.shape[0], -1).to(device=logits.device, dtype=torch.long))

    def mask_padding(self, expert_ids, weights, token_mask):
        """Padding tokens (token_mask False) go nowhere."""
        if token_mask is None:
            return expert_ids, weights
        padding = ~token_mask.view(-1, 1)
        return expert_ids.masked_fill(padding, self.num_experts), weights.masked_fill(padding, 0.0)

    def capacity(self, top_k: int, group_size: int) -> int | None:
        """This mode's per-group expert capacity (`routing.capacity_in_mode`: the one place the rule is written)."""
        return capacity_in_mode(self.capacity_factor, self.eval_capacity_factor, self.training, top_k, group_size,
                                self.num_experts)

    def apply_capacity(self, logits, expert_ids, weights, token_mask, group_size, capacity):
        """Overflowed routes are dropped (sentinel id, weight 0): the token passes through the residual connection."""
        if capacity is None:
            return expert_ids, weights
        E = self.num_experts
        claims = self.capacity_claims(logits, expert_ids)
        if token_mask is not None:
            claims = claims.masked_fill(~token_mask.view(-1, 1), E)
        keep = (expert_ids < E) & (positions_in_expert(claims, E, group_size) < capacity)
        return expert_ids.masked_fill(~keep, E), weights.masked_fill(~keep, 0.0)

    def forward(
        self,
        hidden_states: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        *,
        compute_losses: bool | None = None,
        expert_ids: torch.Tensor | None = None,
        sequence_length: int | None = None,
    ) -> Routing:
        """hidden_states [T, H], token_mask [T] (False for padding) -> Routing. The losses and statistics are
        computed when `compute_losses` says so, by default when gradients are on (`losses.losses_wanted`).
        expert_ids [T, K]: router replay (the routes are these; weights, capacity and padding as usual).
        sequence_length: tokens per sequence (for the "sequence" aux-loss scope)."""
        T, E = hidden_states.shape[0], self.num_experts
        logits = self.gating(self.apply_input_jitter(hidden_states))  # [T, E]
        selected, weights, probs = self.routing(logits, expert_ids)
        real_routes, weights = self.mask_padding(selected, weights, token_mask)
        group_size = group_size_for(T, self.num_groups)
        capacity = self.capacity(real_routes.shape[1], group_size)
        routed, weights = self.apply_capacity(logits, real_routes, weights, token_mask, group_size, capacity)
        routing = Routing(routed, weights, logits, E, group_size, capacity)
        if not losses_wanted(compute_losses):
            return routing
        return self.statistics_and_losses(routing, real_routes, selected, probs, token_mask, sequence_length)

    def loss_group_size(self, num_tokens: int, group_size: int, sequence_length: int | None) -> int:
        """Tokens per group of the load-balancing loss: GShard's groups ("micro_batch"), each sequence ("sequence"),
        or the whole input, whose fraction may come from the global batch ("global_batch")."""
        if self.aux_loss_scope == "sequence":
            return sequence_length or num_tokens
        if self.aux_loss_scope == "global_batch":
            return num_tokens
        return group_size

    def statistics_and_losses(self, routing: Routing, real_routes, selected, probs, token_mask, sequence_length) -> Routing:
        """The Routing with its statistics (routes received, dropped fraction) and losses (aux as
        `router_aux_loss_scope` says, z). real_routes: the real tokens' routes before capacity (padding removed);
        selected: before padding. The "global_batch" scope also returns what its loss counted (`assigned_per_expert`,
        `num_tokens`), which `balance.LoadBalancer` sums over the step; no other scope counts them."""
        E, T = self.num_experts, routing.expert_ids.shape[0]
        device = routing.expert_ids.device
        with torch.no_grad():  # routes each expert received (real tokens, after capacity): counted, not one-hot
            received = route_counts(routing.expert_ids.reshape(-1), E + 1, torch.float32)
            if routing.capacity is None and token_mask is None:
                dropped_fraction = torch.zeros((), device=device)
            else:
                num_real_routes = (real_routes < E).sum()
                dropped_fraction = (num_real_routes - received[:E].sum()) / num_real_routes.clamp(min=1)
        routes, share = self.assignment(selected)
        group = self.loss_group_size(T, routing.group_size, sequence_length)
        counted = {}
        if self.aux_loss_scope == "global_batch":
            with torch.no_grad():
                mask = None if token_mask is None else token_mask.view(T, 1).expand(routes.shape).reshape(-1)
                assigned = route_counts(routes.reshape(-1), E + 1, torch.float32, mask)[:E] * share
                num_tokens = torch.full((), float(T), device=device) if token_mask is None else token_mask.float().sum()
            counted = dict(assigned_per_expert=assigned, num_tokens=num_tokens)
            # the last step's global-batch fraction once there is one (the first step: this input's)
            local = (assigned / num_tokens.clamp(min=1)).unsqueeze(0)
            fraction = torch.where(self.global_fraction.sum() > 0, self.global_fraction.unsqueeze(0), local)
        elif routes is routing.expert_ids and group >= T:  # every route counted, none dropped or padded, one group
            fraction = (received[:E] * (share / T)).unsqueeze(0)
        else:
            fraction = route_fractions(routes, share, token_mask, E, group)
        return routing._replace(
            aux_loss=self.load_balancing_loss(probs, fraction, token_mask, group),
            z_loss=self.z_loss(routing.router_logits, token_mask),
            tokens_per_expert=received[:E],
            dropped_fraction=dropped_fraction,
            **counted,
        )


@register_gate("switch")
class SwitchGate(Gate):
    """Switch Transformer top-1: the token goes to its most probable expert, weighted by that probability."""

    @classmethod
    def check_config(cls, config):
        super().check_config(config)
        if config.num_experts_per_tok != 1:
            raise ValueError(
                f"router_type='switch' routes each token to 1 expert, but num_experts_per_tok="
                f"{config.num_experts_per_tok}. Set num_experts_per_tok=1, or use router_type='topk'."
            )

    def select(self, logits):
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weight, expert = probs.max(dim=-1, keepdim=True)
        return expert, weight, probs

    def replay(self, logits, expert_ids):
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        return expert_ids, gather_routes(probs, expert_ids), probs


@register_gate("topk")
class TopKGate(Gate):
    """Top-k of the scores over all experts, optionally renormalised to sum to one, times `routed_scaling_factor`.

    Scores: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3, GLM-4-MoE: `router_score_function="sigmoid"`, each score
    sigmoid(W x) on its own; the balance loss reads them normalised to sum to one over the experts, as DeepSeek-V3's
    sequence-wise loss does). With `router_expert_bias` the experts are chosen by scores + `expert_bias` while the
    weights stay the scores themselves (DeepSeek-V3's aux-loss-free balancing). With `num_expert_groups` N > 1 the
    experts form N expert groups of E/N consecutive experts; an expert group's score is the sum of its two best choice
    scores, and a token's experts come from its `topk_expert_groups` best expert groups (DeepSeek-V3's group-limited
    routing)."""

    supports_expert_bias = True

    def __init__(self, config):
        super().__init__(config)
        self.normalize = config.norm_topk_prob
        self.weighting = config.topk_weighting
        self.score_function = config.router_score_function
        self.scaling = config.routed_scaling_factor
        self.num_expert_groups, self.topk_expert_groups = self.expert_groups(config)

    @staticmethod
    def expert_groups(config) -> tuple[int, int]:
        """(num_expert_groups, topk_expert_groups) of `config`; topk_expert_groups None means every expert group."""
        return config.num_expert_groups, config.topk_expert_groups or config.num_expert_groups

    def scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] -> (scores [T, E] the weights are taken from, probs [T, E] of the balance loss), float32."""
        if self.score_function == "sigmoid":
            scores = logits.float().sigmoid()
            return scores, scores / scores.sum(dim=-1, keepdim=True).clamp(min=1e-20)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        return probs, probs

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [T, E] -> expert_ids [T, K]: top-k of scores + expert_bias, within the token's best expert groups."""
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if self.num_expert_groups > 1:
            choice = self.limit_to_expert_groups(choice)
        return choice.topk(self.top_k, dim=-1).indices

    def limit_to_expert_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] with the experts outside each token's `topk_expert_groups` best expert groups set to -inf."""
        T, E, N = choice.shape[0], self.num_experts, self.num_expert_groups
        by_expert_group = choice.view(T, N, E // N)
        expert_group_scores = by_expert_group.topk(min(2, E // N), dim=-1).values.sum(dim=-1)  # [T, N]
        best = expert_group_scores.topk(self.topk_expert_groups, dim=-1).indices
        keep = torch.zeros(T, N, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
        return by_expert_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)

    def weigh(self, scores: torch.Tensor, expert_ids: torch.Tensor, top_scores: torch.Tensor | None = None):
        """The combine weights [T, K] of the routes expert_ids [T, K] (sentinel: 0), from the unbiased scores;
        `top_scores`: those scores at expert_ids when the caller has them (no sentinel among the ids then)."""
        weights = gather_routes(scores, expert_ids) if top_scores is None else top_scores
        if self.weighting == "m6t":  # M6-T Eq. (1): p = softmax(g), g = topk(softmax(W x))
            if top_scores is None:  # a sentinel route gets 0
                weights = weights.masked_fill(expert_ids >= self.num_experts, float("-inf"))
                weights = weights.softmax(dim=-1).nan_to_num(0.0)
            else:
                weights = weights.softmax(dim=-1)
        elif self.normalize:  # top scores are positive; replayed routes may all be the sentinel (sum 0)
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total if top_scores is not None else total.clamp(min=1e-20))
        return weights * self.scaling if self.scaling != 1.0 else weights

    def select(self, logits):
        scores, probs = self.scores(logits)
        if self.expert_bias is None and self.num_expert_groups == 1:  # the top-k values are the weights' scores
            top_scores, experts = scores.topk(self.top_k, dim=-1)
            return experts, self.weigh(scores, experts, top_scores), probs
        experts = self.choose(scores)
        return experts, self.weigh(scores, experts), probs

    def replay(self, logits, expert_ids):
        scores, probs = self.scores(logits)
        return expert_ids, self.weigh(scores, expert_ids), probs

    @classmethod
    def check_config(cls, config):
        super().check_config(config)
        E, (N, topk) = config.num_experts, cls.expert_groups(config)
        if N > 1 and (E % N or not 1 <= topk <= N or config.num_experts_per_tok > topk * (E // N)):
            raise ValueError(
                f"num_expert_groups={N}, topk_expert_groups={topk}: the expert groups must divide num_experts={E}, "
                f"1 <= topk_expert_groups <= num_expert_groups, and the chosen expert groups must hold "
                f"num_experts_per_tok={config.num_experts_per_tok} experts."
            )


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
        self.skipped_routes_take_capacity = config.router_random_routing_takes_capacity

    @classmethod
    def check_config(cls, config):
        super().check_config(config)
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

    def replay(self, logits, expert_ids):
        # g_k = p_k / (p_1 + p_2); a second route given as the sentinel (skipped by random routing when recorded) is
        # normalised as select did, by the best probability among the other experts
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        given = gather_routes(probs, expert_ids)
        others = probs.scatter(1, expert_ids[:, :1].clamp(max=self.num_experts - 1), 0.0).max(dim=-1).values
        second = torch.where(expert_ids[:, 1] < self.num_experts, given[:, 1], others)
        return expert_ids, given / (given[:, :1] + second.unsqueeze(-1)), probs

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
        super().check_config(config)
        if config.num_experts % config.num_experts_per_tok != 0:
            raise ValueError(
                f"router_type='prototype' splits num_experts={config.num_experts} into num_experts_per_tok="
                f"{config.num_experts_per_tok} prototypes, which must divide it evenly. Choose num_experts_per_tok "
                "among the divisors of num_experts."
            )

    def _probs(self, logits):
        T, Z, Fp = logits.shape[0], self.num_prototypes, self.experts_per_prototype
        return logits.view(T, Z, Fp).softmax(dim=-1, dtype=torch.float32)  # one softmax per prototype

    def select(self, logits):
        probs = self._probs(logits)
        weights, local = probs.max(dim=-1)  # [T, Z]
        experts = local + torch.arange(self.num_prototypes, device=logits.device) * self.experts_per_prototype
        return experts, weights, probs.flatten(1)

    def replay(self, logits, expert_ids):
        probs = self._probs(logits).flatten(1)
        return expert_ids, gather_routes(probs, expert_ids), probs

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
