"""Expert weights and their kernels (experts implementations).

Legend: T tokens, H hidden, I expert inner size, E experts (held by this module), K routes per token,
N routes that reach an expert, G groups, S group size, C capacity.

`Experts` stores the weights of E feed-forward experts stacked along dim 0 in nn.Linear's orientation, output
dimension first (Transformers' Mixtral layout, `is_transposed=False`): `gate_up_proj [E, 2I, H]` = [gate ; up]
along dim 1 for gated MLPs or `up_proj [E, I, H]`, `down_proj [E, H, I]`, optional biases `[E, 2I or I]`, `[E, H]`.
The kernels below multiply `x @ W[e].T` (input-first views of these tensors); why this orientation:
CHANGELOG.md, Generation, 2026-11-22.

It is called with the experts contract `(hidden_states [T, H], expert_ids [T, K], weights [T, K])` — Transformers'
`forward(hidden_states, top_k_index, top_k_weights)`; ids equal to `num_experts` are skipped. The kernel is the
model's `experts_implementation`, as Transformers names it (`config._experts_implementation`,
`from_pretrained(..., experts_implementation=...)`, `model.set_experts_implementation(...)`). `Experts.forward` looks
the implementation up in one registry, `EXPERTS_FUNCTIONS` (Transformers' `ExpertsInterface` with ours added), by the
name `Experts.implementation` gives for the call. Ours ("index", "einsum" and the forms the table picks) read this
module's weights and config, so they are registered there only, not in Transformers' global `ExpertsInterface`, where
Transformers' own experts modules would find them; our models accept their names
(`MoEPreTrainedModel.get_correct_experts_implementation`).


- `"index"` (PPMoE Algorithm 1, the default; also Transformers' "eager", the module's own): the capability table (`kernels.CAPABILITIES`) picks
  `index_kernel` / `index_loop` (sort the routes by expert once, gather, two grouped GEMMs, gather back, weight:
  work proportional to the routes, no padding, no one-hot tensors) or, without gradients, `all_experts` /
  `cpu_decode` (decoding forms).
- `"einsum"` (GShard Algorithm 2): one-hot dispatch and combine tensors [G, S, E, C] and batched einsums
  over a static per-expert buffer. Memory and time grow with E * C; kept as the reference formulation.
- any name registered in Transformers' `ExpertsInterface` (`grouped_mm`, `batched_mm`, ...): their kernels run on
  our weights unchanged; `grouped_mm` only where the table gives torch's kernel, else the table's choice, with one
  warning that says why (sizes off the kernel's 16-byte rule, float64, ...).

All give the same numbers for the same routing.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.integrations.moe import ExpertsInterface
from transformers.utils import logging

from ..utils.transformers_private import mark_expert_parallel
from .kernels import aligned, autocast_dtype, capability, device_capability, grouped_mm, warn_if_no_grouped_mm
from .quantized import quantized_weight
from .routing import capacity_in_mode, group_size_for, positions_in_expert

logger = logging.get_logger(__name__)


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
    """E experts with stacked weights; see the module docstring for the layout and the experts implementations."""

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
        self.initializer_range = config.initializer_range
        self.reset_parameters()
        self.act_fn = ACT2FN[config.hidden_act]
        self.swiglu = self.has_gate and config.hidden_act in ("silu", "swish")
        warn_if_no_grouped_mm()
        # attributes read by Transformers' experts kernels; sentinel routes are masked there when this is True
        self.config = config
        self.is_transposed = False
        self.is_concatenated = True
        self.has_post_expert_norm = False
        mark_expert_parallel(self)

    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) weights and zero biases: the one place the experts' initialisation is written
        (the model's `_init_weights` calls it; Transformers' `init` functions skip tensors loaded from a checkpoint)."""
        init.normal_(self.in_proj, std=self.initializer_range)
        init.normal_(self.down_proj, std=self.initializer_range)
        if self.has_bias:
            init.zeros_(self.in_proj_bias)
            init.zeros_(self.down_proj_bias)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_dim}, intermediate_size={self.intermediate_dim}, "
            f"gated={self.has_gate}, bias={self.has_bias}, experts_implementation={self.experts_implementation!r}"
        )

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.swiglu and not torch.compiler.is_compiling():
            return _SwiGLU.apply(gate_up)
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

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H], top_k_index [T, K] (expert ids; `num_experts`: a route that goes nowhere),
        top_k_weights [T, K] -> [T, H]: Transformers' experts interface, names included (its expert-parallel wrapper
        and serving engines' Transformers backends call it so)."""
        implementation = EXPERTS_FUNCTIONS[self.implementation(hidden_states, top_k_index)]
        return implementation(self, hidden_states, top_k_index, top_k_weights)

    @property
    def experts_implementation(self) -> str:
        """The kernel chosen for the model (`config._experts_implementation`): "index" when none was chosen (a layer
        built outside a model) or Transformers' "eager" (the module's own forward) was."""
        name = self.config._experts_implementation
        return "index" if name in (None, "eager") else name

    def implementation(self, hidden_states: torch.Tensor, expert_ids: torch.Tensor) -> str:
        """The name in `EXPERTS_FUNCTIONS` that runs this call. "index": the capability table's choice
        (`kernels.CAPABILITIES`); Transformers' `grouped_mm` where the table gives torch's kernel, else the table's
        choice too, said once (`warn_grouped_mm_fallback`); any other name as set."""
        name = self.experts_implementation
        if name == "grouped_mm" and table_choice(self, hidden_states, expert_ids, grad=True) == "index_kernel":
            return "grouped_mm"
        if name not in ("index", "grouped_mm"):
            return name
        choice = table_choice(self, hidden_states, expert_ids, torch.is_grad_enabled())
        if name == "grouped_mm":
            warn_grouped_mm_fallback(self, hidden_states, choice)
        return choice


def table_choice(experts: Experts, x: torch.Tensor, expert_ids: torch.Tensor, grad: bool) -> str:
    """The capability table's implementation for this call: device, compute capability, compute dtype (autocast's
    where it is on), eager or compiled, gradients, tokens and routes, and the kernel's 16-byte rule on H and I."""
    device, dtype = x.device, autocast_dtype(x.device.type) or x.dtype
    T, K = expert_ids.shape
    ok = aligned(dtype, experts.hidden_dim, experts.intermediate_dim)
    row = capability(device.type, device_capability(device), dtype, torch.compiler.is_compiling(), grad, T, T * K, ok)
    return row.implementation


def warn_grouped_mm_fallback(experts: Experts, x: torch.Tensor, choice: str) -> None:
    """Say once why `experts_implementation="grouped_mm"` runs the table's `choice` instead of torch's kernel. Not
    while torch.compile traces (logging would break the graph): the eager runs say it."""
    if torch.compiler.is_compiling():
        return
    dtype = autocast_dtype(x.device.type) or x.dtype
    H, I = experts.hidden_dim, experts.intermediate_dim
    if not aligned(dtype, H, I):
        why = (f"its kernel needs rows of a multiple of 16 bytes, and hidden_size={H} or the experts' intermediate "
               f"size {I} in {str(dtype).removeprefix('torch.')} is not")
    else:
        why = (f"torch's kernel does not run {str(dtype).removeprefix('torch.')} on {x.device.type} here "
               "(hf_ppmoe.moe.kernels.CAPABILITIES)")
    logger.warning_once(
        f'experts_implementation="grouped_mm": {why}; the experts run hf_ppmoe\'s "{choice}" implementation '
        "instead, which computes the same."
    )


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of a [N, 2I] (gate ; up) GEMM output, with a backward that writes the [N, 2I] gradient in
    place of autograd's two halves and their concatenation (one [N, 2I] copy less per step). In float32 a chain of
    in-place products (no temporaries: 20% faster than autograd's on CPU); in bfloat16/float16 autograd's own
    operations, bit for bit, each written into its half. Eager only: torch.compile fuses autograd's version into one
    kernel anyway (and cannot trace `out=` into strided views)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        silu = F.silu(gate)
        ctx.save_for_backward(gate_up, None if gate_up.dtype == torch.float32 else silu)
        return silu.mul_(up) if gate_up.dtype == torch.float32 else silu * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        gate_up, silu = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad_gate_up = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
        if silu is not None:  # autograd's: d up = grad * silu(gate); d gate = silu_backward(grad * up, gate)
            torch.mul(grad, silu, out=grad_up)
            torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
            return grad_gate_up
        sig = torch.sigmoid(gate)
        torch.mul(gate, sig, out=grad_up).mul_(grad)  # d/d up = silu(gate)
        # d/d gate = up * silu'(gate) = up * sig * (1 + gate * (1 - sig))
        torch.mul(sig, -1, out=grad_gate).add_(1).mul_(gate).add_(1).mul_(sig).mul_(up).mul_(grad)
        return grad_gate_up


def computes_in_autocast_dtype(fn):
    """Run `fn(experts, x, ...)` with x in autocast's dtype and autocast off: the experts compute in that dtype, as
    nn.Linear layers would (grouped GEMMs are not autocast operators)."""

    @functools.wraps(fn)
    def wrapper(experts, x, *args):
        dtype = autocast_dtype(x.device.type)
        if dtype is not None:
            with torch.autocast(x.device.type, enabled=False):
                return fn(experts, x.to(dtype), *args)
        return fn(experts, x, *args)

    return wrapper


def _index(experts: Experts, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, kernel: bool):
    """PPMoE Algorithm 1 on the device with static shapes: sort the T*K routes by expert once, gather every route's
    token row, run all experts as two grouped GEMMs over the sorted rows with device-side offsets, and gather each
    token's K outputs back to sum them with its routing weights.

    Every expert's block also holds one anchor row of zeros, so no block is empty (an empty group's weight gradient
    is the kernel's to decide, and some GPUs write garbage there) and a route that goes nowhere (dropped, padding, an
    expert on another rank: weight 0) reads the last anchor's output, finite (zero without biases). Such routes sort
    past the last offset, where the kernels compute nothing and write nothing: no row there is ever read again,
    forward or backward, so nothing is masked. Weight gradients come from torch's own grouped GEMM autograd, in the
    parameters' layout. No shape depends on the routing: torch.compile traces one graph, and with torch's kernel
    (`kernel=True`) nothing leaves the device.

    A call without gradients and with few routes (decoding: fewer than 4 per expert, where most experts get none)
    has one anchor only, in the block of the smallest expert it routes to: an anchor in every block would make the
    kernel read every expert's weights, which is what bounds a decoding step."""
    T, K = expert_ids.shape
    E, N = experts.num_experts, expert_ids.numel()
    ids = expert_ids.reshape(-1)
    experts_range = torch.arange(E, device=x.device)
    few = not torch.is_grad_enabled() and N < 4 * E
    anchors = expert_ids.amin().clamp(max=E - 1).view(1) if few else experts_range
    sorted_ids, order = torch.sort(torch.cat([ids, anchors]), stable=True)  # sentinels last
    offsets = torch.searchsorted(sorted_ids, experts_range, right=True, out_int32=True)  # end row of each block
    A = anchors.numel()
    row_of = torch.empty_like(order).scatter_(0, order, torch.arange(N + A, device=x.device))  # inverse permutation
    # each route's row in the sorted order; a route that goes nowhere (sorted past every block) reads an anchor: the
    # last one, expert E-1's (stable sort: after that expert's routes, the last row of its block), or the only one
    if few:
        route_rows = torch.where(ids < E, row_of[:N], row_of[N])
    else:
        route_rows = row_of[:N].clamp(max=row_of[N + E - 1])
    src = order.clamp(max=T - 1) if K == 1 else (order // K).clamp_(max=T - 1)  # each row's token (anchors: any)
    x_routed = _GatherRoutes.apply(x, src, route_rows, row_of[N:], K)  # [N + A, H], anchor rows zero
    w_in, b_in, w_out, b_out = _parameters(experts, x.dtype)
    if b_in is not None:  # masked: sentinel rows' undefined gradients must not reach expert E-1's biases
        valid, rows_expert = (sorted_ids < E).unsqueeze(-1), sorted_ids.clamp(max=E - 1)
    h = grouped_mm(x_routed, w_in, offsets, kernel)
    if b_in is not None:
        h = h + torch.where(valid, b_in.index_select(0, rows_expert), 0.0)
    y = grouped_mm(experts._activate(h), w_out, offsets, kernel)
    if b_out is not None:
        y = y + torch.where(valid, b_out.index_select(0, rows_expert), 0.0)
    y = y.index_select(0, route_rows)  # [T*K, H] in route order
    if K == 1:
        return y * weights.to(y.dtype)
    # each token's weighted sum of its K outputs as one batched product (float32 accumulation, one pass)
    return torch.bmm(weights.to(y.dtype).unsqueeze(1), y.view(T, K, -1)).squeeze(1)


class _GatherRoutes(torch.autograd.Function):
    """Forward: the sorted rows' tokens, `x[src]`, with the anchor rows set to zero. Backward: each token's gradient
    is the sum of its K routes' rows, gathered by `route_rows` (no atomics: deterministic, summed in float32), so the
    rows past the last offset, which the grouped GEMM's backward leaves undefined, are never read."""

    @staticmethod
    def forward(ctx, x, src, route_rows, anchor_rows, K):
        ctx.save_for_backward(route_rows)
        ctx.K = K
        return x.index_select(0, src).index_fill_(0, anchor_rows, 0.0)

    @staticmethod
    def backward(ctx, grad):
        (route_rows,) = ctx.saved_tensors
        grad = grad.index_select(0, route_rows)
        if ctx.K > 1:
            grad = grad.view(-1, ctx.K, grad.shape[-1]).sum(dim=1)
        return grad, None, None, None, None


@computes_in_autocast_dtype
def index_kernel(experts, x, expert_ids, weights):
    """`_index` on torch's grouped GEMM kernel."""
    return _index(experts, x, expert_ids, weights, kernel=True)


@computes_in_autocast_dtype
def index_loop(experts, x, expert_ids, weights):
    """`_index` on the per-expert loop (reads the E offsets on the host)."""
    return _index(experts, x, expert_ids, weights, kernel=False)


def index_experts(experts, x, expert_ids, weights):
    """`experts_implementation="index"`: PPMoE Algorithm 1 or its decoding forms, as the capability table picks for
    this call."""
    name = table_choice(experts, x, expert_ids, torch.is_grad_enabled())
    return EXPERTS_FUNCTIONS[name](experts, x, expert_ids, weights)


@computes_in_autocast_dtype
def all_experts(experts, x, expert_ids, weights):
    """Without gradients: every expert on every token (two batched GEMMs over [E, T, ...]), each token's output the
    routing-weighted sum of its routed experts. No host read and no shape that depends on the routing (a CUDA graph
    can capture it); E/K times the routed FLOPs, which decoding batches hide behind reading the weights."""
    T, E = x.shape[0], experts.num_experts
    routed = torch.zeros(T, E + 1, dtype=torch.bool, device=x.device).scatter_(1, expert_ids, True)[:, :E]
    combine = torch.zeros(T, E + 1, dtype=x.dtype, device=x.device)
    combine = combine.scatter_add_(1, expert_ids, weights.to(x.dtype))[:, :E]
    w_in, b_in, w_out, b_out = _parameters(experts, x.dtype)
    h = torch.matmul(x, w_in)  # [E, T, 2I or I]
    if b_in is not None:
        h = h + b_in.unsqueeze(1)
    y = torch.matmul(experts._activate(h), w_out)  # [E, T, H]
    if b_out is not None:
        y = y + b_out.unsqueeze(1)
    # selected, not multiplied: an unrouted expert's non-finite output must not reach the token (0 * inf is NaN)
    y = torch.where(routed.t().unsqueeze(-1), y * combine.t().unsqueeze(-1), 0.0)
    return y.sum(0)


@computes_in_autocast_dtype
def cpu_decode(experts, x, expert_ids, weights):
    """One or two routes (batch-1 decoding on CPU, eager only): each runs straight on its token's row with the stored
    weights, a handful of operators whatever E is. Reading two ids on the host costs nothing on a CPU."""
    T, K = expert_ids.shape
    E = experts.num_experts
    out = x.new_zeros(T, x.shape[-1])
    for r, (e, w) in enumerate(zip(expert_ids.reshape(-1).tolist(), weights.reshape(-1).tolist())):
        if e < E:
            t = r // K
            out[t : t + 1].add_(_one_expert(experts, x[t : t + 1], e).mul_(w))
    return out


def _one_expert(experts, x, e):
    """Expert e on the rows x, straight from the stored (output-first) weights, cast to x's dtype where they differ
    (quantized weights: expert e alone dequantized, `hf_ppmoe.moe.quantized`)."""
    in_name = "gate_up_proj" if experts.has_gate else "up_proj"
    w_in, w_out = _expert_matrix(experts, in_name, e), _expert_matrix(experts, "down_proj", e)
    b_in, b_out = (experts.in_proj_bias[e], experts.down_proj_bias[e]) if experts.has_bias else (None, None)
    if w_in.dtype != x.dtype:  # autocast: only the experts in use are cast
        w_in, w_out = w_in.to(x.dtype), w_out.to(x.dtype)
        b_in, b_out = (None, None) if b_in is None else (b_in.to(x.dtype), b_out.to(x.dtype))
    return F.linear(experts._activate(F.linear(x, w_in, b_in)), w_out, b_out)


def _expert_matrix(experts, name: str, e: int) -> torch.Tensor:
    """Expert e's [O, I] matrix of the stacked weight `name`; from quantized storage, that expert alone dequantized."""
    storage = quantized_weight(experts, name)
    return getattr(experts, name)[e] if storage is None else storage.dequantize_expert(e)


def _parameters(experts: Experts, dtype: torch.dtype):
    """(in weight, in bias, down weight, down bias) in `dtype` (the stored tensors when they have it already)."""
    w_in, w_out = (w.to(dtype).transpose(-2, -1) for w in (experts.in_proj, experts.down_proj))  # input-first views
    b_in, b_out = experts.in_proj_bias, experts.down_proj_bias if experts.has_bias else None
    return w_in, None if b_in is None else b_in.to(dtype), w_out, None if b_out is None else b_out.to(dtype)


def einsum_experts(
    experts: Experts,
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    group_size: int | None = None,
    capacity: int | None = None,
) -> torch.Tensor:
    """GShard Algorithm 2 with one-hot dispatch/combine tensors of shape [G, S, E, C].

    C defaults to the largest per-group expert load of this batch on CPU in eager mode (the gate has already applied
    any capacity: a route over capacity arrives as the sentinel), elsewhere (no host read) to the gate's capacity,
    or S for a dropless gate.

    The dispatch and combine einsums sum over all tokens of a group with 0/1 coefficients, and 0 * NaN is NaN: a
    token with a non-finite input would turn every buffer slot, hence every token's output, NaN. Such tokens are
    dispatched as zeros and their outputs set to NaN afterwards, so a non-finite value stays in its own token (as in
    the `index` implementation, which never mixes tokens); two elementwise operations, no host sync.
    """
    finite = torch.isfinite(x).all(-1, keepdim=True)  # [T, 1]
    x = x.masked_fill(~finite, 0.0)
    out = _einsum_buffers(experts, x, expert_ids, weights, group_size, capacity)
    return out.masked_fill(~finite, float("nan"))


def _gate_capacity(experts, top_k, group_size) -> int | None:
    """The capacity the gate applied to this call's routes (None: dropless), by the gate's own rule
    (`routing.capacity_in_mode`) on the config it was built with: the experts' contract carries no capacity."""
    c = experts.config
    return capacity_in_mode(c.capacity_factor, c.eval_capacity_factor, experts.training, top_k, group_size, c.num_experts)


def _einsum_buffers(experts, x, expert_ids, weights, group_size, capacity) -> torch.Tensor:
    T, K = expert_ids.shape
    E, H = experts.num_experts, x.shape[-1]
    S = group_size or T
    G = math.ceil(T / S)
    positions = positions_in_expert(expert_ids, E, S)  # [T, K]
    routed = expert_ids < E
    if capacity is None:
        if x.device.type == "cpu" and not torch.compiler.is_compiling():
            capacity = int(positions.masked_fill(~routed, -1).max().item()) + 1 if bool(routed.any()) else 1
        else:  # no host read: the gate's capacity bounds every kept route's slot; dropless, S slots always suffice
            capacity = min(S, _gate_capacity(experts, K, S) or S)
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


def _einsum_by_config(experts, x, expert_ids, weights):
    """`experts_implementation="einsum"`: GShard's groups as the gate made them."""
    return einsum_experts(experts, x, expert_ids, weights, group_size_for(len(x), experts.config.router_num_groups))


# The names a user chooses among ours: our models accept them besides Transformers' (`from_pretrained(...,
# experts_implementation="einsum")`, `set_experts_implementation`).
EXPERTS_IMPLEMENTATIONS = ("index", "einsum")

# One registry for `Experts.forward`: Transformers' experts implementations (`grouped_mm`, `batched_mm`, ...), ours,
# and the forms the capability table picks between. A local one: ours read `Experts`' weights and config, so
# Transformers' global `ExpertsInterface`, which its own experts modules read, does not list them.
EXPERTS_FUNCTIONS = ExpertsInterface()
EXPERTS_FUNCTIONS.update(
    index=index_experts,
    einsum=_einsum_by_config,
    index_kernel=index_kernel,
    index_loop=index_loop,
    all_experts=all_experts,
    cpu_decode=cpu_decode,
)
