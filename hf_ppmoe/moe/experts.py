"""Expert weights and their dispatch implementations.

Legend: T tokens, H hidden, I expert inner size, E experts (held by this module), K routes per token,
N routes that reach an expert, G groups, S group size, C capacity.

`Experts` stores the weights of E feed-forward experts stacked along dim 0, in Transformers' layout
(`gate_up_proj [E, 2I, H]` = [gate; up] for gated MLPs or `up_proj [E, I, H]`, `down_proj [E, H, I]`, optional
biases), and is called with the experts contract `(hidden_states [T, H], expert_ids [T, K], weights [T, K])`; ids
equal to `num_experts` are skipped. The implementation is picked by `config.dispatch`:

- `index`  (PPMoE Algorithm 1, the default): sort the routes by expert once, `index_select` the tokens each expert
           gets, run the experts one after another on their contiguous slices, weight, and add back with `index_add`.
           Work is proportional to the routes that reach an expert; no padding, no one-hot tensors.
- `einsum` (GShard Algorithm 2): one-hot dispatch and combine tensors [G, S, E, C] and batched einsums over a
           static per-expert buffer. Memory and time grow with E * C; kept as the reference formulation.
- any name registered in Transformers' `ExpertsInterface` (`grouped_mm`, `batched_mm`, ...): their kernels run on
           our weights unchanged.

All give the same numbers for the same routing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .routing import positions_in_expert


class MLP(nn.Module):
    """Dense feed-forward block: `down(act(gate(x)) * up(x))` when gated (Llama), `down(act(up(x)))` otherwise (GPT-2)."""

    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        H, I = config.hidden_size, intermediate_size or config.intermediate_size
        self.gated = config.gated_mlp
        if self.gated:
            self.gate_proj = nn.Linear(H, I, bias=config.mlp_bias)
        self.up_proj = nn.Linear(H, I, bias=config.mlp_bias)
        self.down_proj = nn.Linear(I, H, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x) if self.gated else self.act_fn(self.up_proj(x))
        return self.down_proj(h)


class Experts(nn.Module):
    """E experts with stacked weights; see the module docstring for the layout and the dispatch implementations."""

    def __init__(self, config, num_experts: int | None = None, intermediate_size: int | None = None):
        super().__init__()
        E = num_experts if num_experts is not None else config.num_experts
        H = config.hidden_size
        I = intermediate_size or config.moe_intermediate_size or config.intermediate_size
        self.num_experts, self.hidden_dim, self.intermediate_dim = E, H, I
        self.has_gate, self.has_bias = config.gated_mlp, config.mlp_bias
        if self.has_gate:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        else:
            self.up_proj = nn.Parameter(torch.empty(E, I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))
        if self.has_bias:
            if self.has_gate:
                self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
            else:
                self.up_proj_bias = nn.Parameter(torch.zeros(E, I))
            self.down_proj_bias = nn.Parameter(torch.zeros(E, H))
        std = getattr(config, "initializer_range", 0.02)
        nn.init.normal_(self.in_proj, std=std)
        nn.init.normal_(self.down_proj, std=std)
        self.act_fn = ACT2FN[config.hidden_act]
        self.dispatch = config.dispatch
        # attributes read by Transformers' experts kernels; sentinel routes are masked there when this is True
        self.config = config
        self.is_transposed = False
        self.is_concatenated = True
        self.has_post_expert_norm = False
        self._is_expert_parallel = True

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    @property
    def in_proj(self) -> nn.Parameter:
        return self.gate_up_proj if self.has_gate else self.up_proj

    @property
    def in_proj_bias(self) -> nn.Parameter | None:
        if not self.has_bias:
            return None
        return self.gate_up_proj_bias if self.has_gate else self.up_proj_bias

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        return self._apply_gate(h) if self.has_gate else self.act_fn(h)

    def forward(
        self,
        hidden_states: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        *,
        group_size: int | None = None,
        capacity: int | None = None,
    ) -> torch.Tensor:
        if self.dispatch == "index":
            return index_dispatch(self, hidden_states, expert_ids, weights)
        if self.dispatch == "einsum":
            return einsum_dispatch(self, hidden_states, expert_ids, weights, group_size, capacity)
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        return ALL_EXPERTS_FUNCTIONS[self.dispatch](self, hidden_states, expert_ids, weights)


def index_dispatch(experts: Experts, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """PPMoE Algorithm 1: index_select each expert's tokens, run the expert, write back into a zero tensor."""
    T, K = expert_ids.shape
    E = experts.num_experts
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # routes grouped by expert, sentinels last
    counts = torch.bincount(flat_ids, minlength=E + 1)[:E].tolist()  # the one host sync of the layer
    routed = sum(counts)
    order = order[:routed]
    token_idx = order // K if K > 1 else order
    x_routed = x.index_select(0, token_idx)  # [N, H], contiguous per expert

    w_in, w_out = experts.in_proj.unbind(0), experts.down_proj.unbind(0)  # unbind: one gradient buffer per weight
    b_in = experts.in_proj_bias.unbind(0) if experts.has_bias else None
    b_out = experts.down_proj_bias.unbind(0) if experts.has_bias else None
    outputs = []
    for e, x_e in enumerate(x_routed.split(counts)):
        if counts[e] == 0:
            continue
        h = experts._activate(F.linear(x_e, w_in[e], b_in[e] if b_in else None))
        outputs.append(F.linear(h, w_out[e], b_out[e] if b_out else None))
    out = x.new_zeros(T, x.shape[-1])
    if not outputs:
        return out
    y = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    y = y * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(y.dtype)
    return out.index_add(0, token_idx, y)


def einsum_dispatch(
    experts: Experts,
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    group_size: int | None,
    capacity: int | None,
) -> torch.Tensor:
    """GShard Algorithm 2 with one-hot dispatch/combine tensors of static shape [G, S, E, C].

    With a capacity, C is the gate's per-group capacity; dropless routing has no static bound, so C is the
    largest per-group expert load of this batch.
    """
    T, K = expert_ids.shape
    E, H = experts.num_experts, x.shape[-1]
    S = group_size or T
    G = math.ceil(T / S)
    positions = positions_in_expert(expert_ids, E, S)  # [T, K]
    routed = expert_ids < E
    if capacity is None:
        capacity = int(positions.masked_fill(~routed, -1).max().item()) + 1 if bool(routed.any()) else 1
    # [T, K, E] x [T, K, C] -> [T, E, C]; sentinel routes have an all-zero expert one-hot
    expert_1h = F.one_hot(expert_ids, E + 1)[..., :E].to(x.dtype)
    slot_1h = F.one_hot(positions.clamp(0, capacity - 1), capacity).to(x.dtype) * routed.unsqueeze(-1)
    dispatch = torch.einsum("tke,tkc->tec", expert_1h, slot_1h)
    combine = torch.einsum("tke,tkc->tec", expert_1h * weights.to(x.dtype).unsqueeze(-1), slot_1h)
    pad = G * S - T
    if pad:
        dispatch, combine = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (dispatch, combine))
        x = F.pad(x, (0, 0, 0, pad))
    dispatch, combine = dispatch.view(G, S, E, capacity), combine.view(G, S, E, capacity)
    x = x.view(G, S, H)

    inputs = torch.einsum("gsec,gsm->egcm", dispatch, x)
    h = torch.einsum("egcm,eim->egci", inputs, experts.in_proj)
    if experts.has_bias:
        h = h + experts.in_proj_bias[:, None, None, :]
    h = experts._activate(h)
    y = torch.einsum("egci,emi->egcm", h, experts.down_proj)
    if experts.has_bias:
        y = y + experts.down_proj_bias[:, None, None, :]
    out = torch.einsum("gsec,egcm->gsm", combine, y)
    return out.reshape(G * S, H)[:T]
