"""Expert weights and their dispatch implementations.

Legend: T tokens, H hidden, I expert inner size, E experts (held by this module), K routes per token,
N routes that reach an expert, G groups, S group size, C capacity.

`Experts` stores the weights of E feed-forward experts stacked along dim 0 in nn.Linear's orientation, output
dimension first (Transformers' Mixtral layout, `is_transposed=False`): `gate_up_proj [E, 2I, H]` = [gate ; up]
along dim 1 for gated MLPs or `up_proj [E, I, H]`, `down_proj [E, H, I]`, optional biases `[E, 2I or I]`, `[E, H]`.
The kernels below multiply `x @ W[e].T` (input-first views of these tensors). For the many rows of training the
orientation makes no measurable difference; for the few rows of decoding, with the weights coming from memory, it
is 11-28% faster on CPU than input-first storage (benchmarks/RESULTS.md, Generation).

It is called with the experts contract `(hidden_states [T, H], expert_ids [T, K], weights [T, K])`; ids equal to
`num_experts` are skipped. The implementation is picked by `config.dispatch`:

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

from .routing import group_size_for, positions_in_expert


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

    def forward(self, hidden_states: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # exactly these three positional arguments: Transformers' expert-parallel wrapper calls it this way too
        if self.dispatch == "index":
            return index_dispatch(self, hidden_states, expert_ids, weights)
        if self.dispatch == "einsum":
            group_size = group_size_for(len(hidden_states), self.config.router_num_groups)
            return einsum_dispatch(self, hidden_states, expert_ids, weights, group_size)
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        return ALL_EXPERTS_FUNCTIONS[self.dispatch](self, hidden_states, expert_ids, weights)


# below this many routes (decoding), routes are grouped in Python instead of sorted on the device
SMALL_BATCH_ROUTES = 64


def index_dispatch(experts: Experts, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """PPMoE Algorithm 1: index_select each expert's tokens, run the expert, write back into a zero tensor."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # the experts run in autocast's dtype, as nn.Linear layers would; done by hand because the kernels below write
        # into preallocated buffers and run a custom autograd Function, which autocast does not reach into
        with torch.autocast(device, enabled=False):
            return index_dispatch(experts, x.to(torch.get_autocast_dtype(device)), expert_ids, weights)
    T, K = expert_ids.shape
    if T * K <= SMALL_BATCH_ROUTES and not torch.is_grad_enabled():
        return _index_dispatch_few_routes(experts, x, expert_ids, weights)
    E = experts.num_experts
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # routes grouped by expert, sentinels last
    counts = torch.bincount(flat_ids, minlength=E + 1)[:E].tolist()  # the one host sync of the layer
    routed = sum(counts)
    if routed == 0:
        return x.new_zeros(T, x.shape[-1])
    order = order[:routed]
    token_idx = order // K if K > 1 else order
    x_routed = x.index_select(0, token_idx)  # [N, H], contiguous per expert
    args = (x_routed, counts, experts, *_parameters(experts, x.dtype))
    if torch.is_grad_enabled():
        y = _GroupedExpertMLP.apply(*args)
    else:
        y = _grouped_expert_mlp(*args)[0]
    y = y * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(y.dtype)
    return x.new_zeros(T, x.shape[-1]).index_add_(0, token_idx, y)


def _index_dispatch_few_routes(experts, x, expert_ids, weights):
    """`index_dispatch` for the handful of routes of a decoding step: routes sorted on host lists instead of on the
    device; one or two routes (batch-1 decoding) run straight on their token's row with the stored weights, more run
    as two grouped matmuls on CPU (bit-identical there), so the layer costs a few tensor operations per route whatever
    the number of experts. The order of routes, and so of the accumulation, is the one `index_dispatch` uses: by
    expert, then by flat route index."""
    T, K = expert_ids.shape
    E = experts.num_experts
    ids, w = expert_ids.reshape(-1).tolist(), weights.reshape(-1).tolist()
    routes = sorted((e, r) for r, e in enumerate(ids) if e < E)
    if _use_grouped_mm(x, len(routes)):
        counts = [0] * E
        for e, _ in routes:
            counts[e] += 1
        tokens = torch.tensor([r // K for _, r in routes], device=x.device)
        scale = torch.tensor([w[r] for _, r in routes], dtype=x.dtype, device=x.device)
        y = _grouped_mm_expert_mlp(x.index_select(0, tokens), counts, experts, *_parameters(experts, x.dtype))
        return x.new_zeros(T, x.shape[-1]).index_add_(0, tokens, y * scale.unsqueeze(-1))
    out = x.new_zeros(T, x.shape[-1])
    for e, r in routes:
        t = r // K
        out[t : t + 1].add_(_one_expert(experts, x[t : t + 1], e).mul_(w[r]))
    return out


def _one_expert(experts, x, e):
    """Expert e on the rows x, straight from the stored (output-first) weights, cast to x's dtype where they differ."""
    w_in, w_out = experts.in_proj[e], experts.down_proj[e]
    b_in, b_out = (experts.in_proj_bias[e], experts.down_proj_bias[e]) if experts.has_bias else (None, None)
    if w_in.dtype != x.dtype:  # autocast: only the experts in use are cast
        w_in, w_out = w_in.to(x.dtype), w_out.to(x.dtype)
        b_in, b_out = (None, None) if b_in is None else (b_in.to(x.dtype), b_out.to(x.dtype))
    return F.linear(experts._activate(F.linear(x, w_in, b_in)), w_out, b_out)


def _parameters(experts: Experts, dtype: torch.dtype):
    """(in weight, in bias, down weight, down bias) in `dtype` (the stored tensors when they have it already)."""
    w_in, w_out = (w.to(dtype).transpose(-2, -1) for w in (experts.in_proj, experts.down_proj))  # input-first views
    b_in, b_out = experts.in_proj_bias, experts.down_proj_bias if experts.has_bias else None
    return w_in, None if b_in is None else b_in.to(dtype), w_out, None if b_out is None else b_out.to(dtype)


def _use_grouped_mm(x: torch.Tensor, routes: int) -> bool:
    # torch's CPU grouped_mm runs the same per-group GEMMs as our loop (equal results, measured) in one operator,
    # which pays off from a few routes on (batch-1 top-2 decoding is faster with the loop); on GPUs its dtype and
    # architecture requirements vary, so the loop stays there
    return routes > 2 and x.device.type == "cpu" and hasattr(F, "grouped_mm")


def _grouped_mm_expert_mlp(x, counts, experts, w_in, b_in, w_out, b_out):
    offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    a = F.grouped_mm(x, w_in, offs=offsets)
    rows = torch.repeat_interleave(torch.arange(len(counts), device=x.device), torch.tensor(counts, device=x.device))
    if b_in is not None:
        a = a + b_in.index_select(0, rows)
    y = F.grouped_mm(experts._activate(a), w_out, offs=offsets)
    if b_out is not None:
        y = y + b_out.index_select(0, rows)
    return y


def _grouped_expert_mlp(x, counts, experts, w_in, b_in, w_out, b_out):
    """y[rows_e] = down_e(act(in_e(x[rows_e]))) for the contiguous row blocks of each expert.

    Returns y [N, H] and each expert's pre-activations [n_e, 2I or I] (kept for the backward pass). The
    pre-activations are allocated per expert rather than as rows of one [N, 2I] buffer: on CPU a fresh buffer that
    large comes from mmap and every page faults on first write (measured: 20-30% of the up-projection), while
    per-expert blocks are reused from the heap."""
    pre_activations = []
    y = x.new_empty(x.shape[0], w_out.shape[2])
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        start += n
        a = x[rows] @ w_in[e] if b_in is None else torch.addmm(b_in[e], x[rows], w_in[e])
        pre_activations.append(a)
        _linear_into(y[rows], experts._activate(a), w_out[e], None if b_out is None else b_out[e])
    return y, pre_activations


def _linear_into(out, x, weight, bias):
    """out = x @ weight (+ bias), weight [in, out]."""
    if bias is None:
        torch.mm(x, weight, out=out)
    else:
        torch.addmm(bias, x, weight, out=out)


class _GroupedExpertMLP(torch.autograd.Function):
    """The expert loop of `index_dispatch` with a hand-written backward.

    Autograd over per-expert weight slices would allocate one full-size gradient per expert and stack them; here each
    expert's weight gradient is written straight into its slice of one [E, ...] buffer. The activation is recomputed
    from the saved pre-activation in backward (elementwise, cheap), so memory matches plain autograd.
    """

    @staticmethod
    def forward(ctx, x, counts, experts, w_in, b_in, w_out, b_out):
        y, pre_activations = _grouped_expert_mlp(x, counts, experts, w_in, b_in, w_out, b_out)
        ctx.save_for_backward(x, w_in, w_out, *pre_activations)
        ctx.counts, ctx.experts, ctx.has_bias = counts, experts, b_in is not None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, w_in, w_out, *pre_activations = ctx.saved_tensors
        counts, experts = ctx.counts, ctx.experts
        pre_activations = iter(pre_activations)
        need_x, _, _, need_w_in, need_b_in, need_w_out, need_b_out = ctx.needs_input_grad
        grad_x = torch.empty_like(x) if need_x else None
        grad_w_in, grad_w_out = torch.empty_like(w_in), torch.empty_like(w_out)
        grad_b_in = w_in.new_empty(w_in.shape[0], w_in.shape[2]) if ctx.has_bias else None
        grad_b_out = w_out.new_empty(w_out.shape[0], w_out.shape[2]) if ctx.has_bias else None
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                for g in (grad_w_in, grad_w_out, grad_b_in, grad_b_out):
                    if g is not None:
                        g[e].zero_()
                continue
            rows = slice(start, start + n)
            start += n
            with torch.enable_grad():
                a_e = next(pre_activations).detach().requires_grad_(True)
                h = experts._activate(a_e)
            g_y = grad_y[rows]
            torch.mm(h.detach().t(), g_y, out=grad_w_out[e])
            (grad_a,) = torch.autograd.grad(h, a_e, g_y @ w_out[e].t())
            torch.mm(x[rows].t(), grad_a, out=grad_w_in[e])
            if ctx.has_bias:
                torch.sum(g_y, dim=0, out=grad_b_out[e])
                torch.sum(grad_a, dim=0, out=grad_b_in[e])
            if need_x:
                torch.mm(grad_a, w_in[e].t(), out=grad_x[rows])
        return (
            grad_x,
            None,
            None,
            grad_w_in if need_w_in else None,
            grad_b_in if need_b_in else None,
            grad_w_out if need_w_out else None,
            grad_b_out if need_b_out else None,
        )


def einsum_dispatch(
    experts: Experts,
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    group_size: int | None = None,
    capacity: int | None = None,
) -> torch.Tensor:
    """GShard Algorithm 2 with one-hot dispatch/combine tensors of shape [G, S, E, C].

    C defaults to the largest per-group expert load of this batch: the gate has already applied any capacity (a
    route over capacity arrives as the sentinel), so that is all the buffer has to hold. Pass the gate's capacity
    for GShard's static shape.
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
