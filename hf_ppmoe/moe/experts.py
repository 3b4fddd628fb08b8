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
        self.swiglu = self.has_gate and config.hidden_act in ("silu", "swish")
        self.dispatch = config.dispatch
        # attributes read by Transformers' experts kernels; sentinel routes are masked there when this is True
        self.config = config
        self.is_transposed = False
        self.is_concatenated = True
        self.has_post_expert_norm = False
        self._is_expert_parallel = True

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_dim}, intermediate_size={self.intermediate_dim}, "
            f"gated={self.has_gate}, bias={self.has_bias}, dispatch={self.dispatch!r}"
        )

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.swiglu and gate_up.dtype in (torch.float32, torch.float64) and not torch.compiler.is_compiling():
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

    def forward(self, hidden_states: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # exactly these three positional arguments: Transformers' expert-parallel wrapper calls it this way too
        if self.dispatch == "index":
            return index_dispatch(self, hidden_states, expert_ids, weights)
        if self.dispatch == "einsum":
            group_size = group_size_for(len(hidden_states), self.config.router_num_groups)
            return einsum_dispatch(self, hidden_states, expert_ids, weights, group_size)
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        return ALL_EXPERTS_FUNCTIONS[self.dispatch](self, hidden_states, expert_ids, weights)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of a [N, 2I] (gate ; up) GEMM output, with a written-out backward that fills the [N, 2I]
    gradient in place: autograd's own (split, silu_backward, two products, cat) allocates 160 MB more per 4096 x
    2 x 2048 float32 block and takes 20% longer (CPU, one thread; a whole E = 8 MoE layer's training step 8% longer).
    Eager and full precision only: torch.compile fuses autograd's version into one kernel anyway (and cannot trace
    `out=` into strided views), and in bfloat16/float16 this chain of in-place products would round at every step
    where autograd's kernels compute in float32 once."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad_gate_up = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        torch.mul(gate, sig, out=grad_up).mul_(grad)  # d/d up = silu(gate)
        # d/d gate = up * silu'(gate) = up * sig * (1 + gate * (1 - sig))
        torch.mul(sig, -1, out=grad_gate).add_(1).mul_(gate).add_(1).mul_(sig).mul_(up).mul_(grad)
        return grad_gate_up


def index_dispatch(experts: Experts, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """PPMoE Algorithm 1 on the device with static shapes: sort the T*K routes by expert once (sentinel routes sort
    last), gather every route's token row with `index_select`, run all experts as two grouped GEMMs over the sorted
    rows with device-side offsets, weight, and put each route's output back in token order to sum over its K routes.

    Nothing leaves the device and no shape depends on the routing, so a training step makes no host sync and
    `torch.compile` traces the layer as one graph; the number of operators does not grow with E. Sentinel rows (dropped,
    padding or off-rank routes) are computed on zeros past the last offset and masked out, never removed."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # the experts run in autocast's dtype, as nn.Linear layers would; done by hand because grouped GEMMs are not
        # autocast operators
        with torch.autocast(device, enabled=False):
            return index_dispatch(experts, x.to(torch.get_autocast_dtype(device)), expert_ids, weights)
    T, K = expert_ids.shape
    if T * K <= 2 and device == "cpu" and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _few_routes_on_cpu(experts, x, expert_ids, weights)
    E = experts.num_experts
    sorted_ids, order = torch.sort(expert_ids.reshape(-1), stable=True)  # [T*K], by expert then route; sentinels last
    counts = torch.zeros(E + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, sorted_ids, torch.ones_like(sorted_ids, dtype=torch.int32))
    offsets = counts[:E].cumsum(0, dtype=torch.int32)  # end row of each expert's block
    valid = (sorted_ids < E).unsqueeze(-1)  # [T*K, 1]
    # sentinel rows are zeroed before the GEMMs: their gradient, which the kernels leave undefined, stops here
    x_routed = x.index_select(0, order // K).masked_fill_(~valid, 0.0)  # [T*K, H]
    w_in, b_in, w_out, b_out = _parameters(experts, x.dtype)
    rows_expert = sorted_ids.clamp(max=E - 1)
    h = grouped_mm(x_routed, w_in, offsets)
    if b_in is not None:  # masked: the undefined gradients of sentinel rows must not reach expert E-1's bias
        h = h + torch.where(valid, b_in.index_select(0, rows_expert), 0.0)
    y = grouped_mm(experts._activate(h), w_out, offsets)
    if b_out is not None:
        y = y + b_out.index_select(0, rows_expert)
    # masked before the weighting: rows past the last offset are not computed by the kernel and may hold NaN, which a
    # multiplication by 0 would keep (in the output, and in the routing weights' gradient)
    y = y.masked_fill_(~valid, 0.0) * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(y.dtype)
    # back to route order (a permutation: no atomics, deterministic), then each token's K routes summed
    y = torch.empty_like(y).index_copy_(0, order, y)
    return y if K == 1 else y.view(T, K, -1).sum(dim=1)


def _few_routes_on_cpu(experts, x, expert_ids, weights):
    """One or two routes (batch-1 decoding on CPU, eager only): each runs straight on its token's row with the stored
    weights, a handful of operators whatever E is. Reading two ids on the host costs nothing on a CPU; on a GPU, and
    under torch.compile, decoding takes the device path above (no sync, CUDA-graph friendly)."""
    T, K = expert_ids.shape
    E = experts.num_experts
    out = x.new_zeros(T, x.shape[-1])
    for r, (e, w) in enumerate(zip(expert_ids.reshape(-1).tolist(), weights.reshape(-1).tolist())):
        if e < E:
            t = r // K
            out[t : t + 1].add_(_one_expert(experts, x[t : t + 1], e).mul_(w))
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


# ---- grouped GEMM: torch's kernel where it runs, else one opaque per-expert loop ----

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_kernel_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch.nn.functional.grouped_mm` runs `x [N, in] @ w [E, in, out]` here: the torch build has it, the
    dtype is one it takes (float32/bfloat16/float16; under torch.compile only bfloat16, the one its meta kernel
    accepts), both matrix dimensions are multiples of 16 bytes (its stride rule), and on CUDA the GPU is sm80 or newer.
    Decided from shapes, dtypes and the device alone, never by trying."""
    if not hasattr(F, "grouped_mm") or x.dtype != w.dtype:
        return False
    if torch.compiler.is_compiling():
        if x.dtype != torch.bfloat16:
            return False
    elif x.dtype not in _KERNEL_DTYPES:
        return False
    itemsize = x.element_size()
    if (w.shape[1] * itemsize) % 16 or (w.shape[2] * itemsize) % 16:
        return False
    if x.device.type == "cuda":
        return _sm80_or_newer(x.device)
    return x.device.type == "cpu"


@torch.compiler.assume_constant_result  # read once while tracing: torch.compile does not fold this CUDA query itself
def _sm80_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e] for the contiguous row blocks ending at `offsets` (int32 [E]). Rows past
    `offsets[-1]` are left undefined (the caller masks them). x [N, in], w [E, in, out] (any strides) -> [N, out]."""
    if grouped_kernel_available(x, w):
        return F.grouped_mm(x.contiguous() if x.stride(-1) != 1 else x, w, offs=offsets)
    return torch.ops.hf_ppmoe.grouped_mm_loop(x, w, offsets)


# The fallback is a custom operator so that torch.compile sees one opaque node (no graph break) while it reads the
# offsets on the host; it is the path for float64, sizes the kernel's alignment rule refuses, and non-bfloat16 models
# under torch.compile. Its backward is a custom operator too, so autograd never looks inside the loop.


@torch.library.custom_op("hf_ppmoe::grouped_mm_loop", mutates_args=())
def _grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    y = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for e, end in enumerate(offsets.tolist()):  # one host read of E offsets per call
        if end > start:
            torch.mm(x[start:end], w[e], out=y[start:end])
        start = end
    return y


@_grouped_mm_loop.register_fake
def _(x, w, offsets):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("hf_ppmoe::grouped_mm_loop_backward", mutates_args=())
def _grouped_mm_loop_backward(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(grad[start:end], w[e].t(), out=grad_x[start:end])
            torch.mm(x[start:end].t(), grad[start:end], out=grad_w[e])
        start = end
    return grad_x, grad_w


@_grouped_mm_loop_backward.register_fake
def _(x, w, offsets, grad):
    return torch.empty_like(x), torch.empty_like(w)


def _grouped_mm_loop_setup(ctx, inputs, output):
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _grouped_mm_loop_grad(ctx, grad):
    x, w, offsets = ctx.saved_tensors
    grad_x, grad_w = torch.ops.hf_ppmoe.grouped_mm_loop_backward(x, w, offsets, grad.contiguous())
    return grad_x, grad_w, None


_grouped_mm_loop.register_autograd(_grouped_mm_loop_grad, setup_context=_grouped_mm_loop_setup)


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

    The dispatch and combine einsums sum over all tokens of a group with 0/1 coefficients, and 0 * NaN is NaN: a
    token with a non-finite input would turn every buffer slot, hence every token's output, NaN. Such tokens are
    dispatched as zeros and their outputs set to NaN afterwards, so a non-finite value stays in its own token (as in
    the `index` dispatch, which never mixes tokens); two elementwise operations, no host sync.
    """
    finite = torch.isfinite(x).all(-1, keepdim=True)  # [T, 1]
    x = x.masked_fill(~finite, 0.0)
    out = _einsum_dispatch(experts, x, expert_ids, weights, group_size, capacity)
    return out.masked_fill(~finite, float("nan"))


def _einsum_dispatch(experts, x, expert_ids, weights, group_size, capacity) -> torch.Tensor:
    T, K = expert_ids.shape
    E, H = experts.num_experts, x.shape[-1]
    S = group_size or T
    G = math.ceil(T / S)
    positions = positions_in_expert(expert_ids, E, S)  # [T, K]
    routed = expert_ids < E
    if capacity is None:
        if x.device.type == "cpu" and not torch.compiler.is_compiling():
            capacity = int(positions.masked_fill(~routed, -1).max().item()) + 1 if bool(routed.any()) else 1
        else:  # no host read: an expert takes each token of a group at most once, so S slots always suffice
            capacity = S
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
