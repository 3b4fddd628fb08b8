"""The capability table (which implementation runs the experts where, and whether it waits for the device) and the
grouped GEMMs it chooses between.

Legend: T tokens, H hidden, I expert inner size, E experts, N rows (routes), sm CUDA compute capability.

`CAPABILITIES` is read top to bottom; the first row that matches the device, compute capability, compute dtype,
eager or compiled, gradients on or off and the number of tokens names the implementation. The choice
(`Experts.implementation`), the GPU tests' expectations (tests/gpu) and the table in docs/gpu.md all come from it:

- `index_kernel`: PPMoE Algorithm 1 on `torch.nn.functional.grouped_mm` (device-side offsets: no host read).
- `index_loop`:   the same algorithm on one opaque per-expert loop that reads the E offsets on the host.
- `all_experts`:  without gradients, every expert on every token, weighted by the routing (no host read, no
                  data-dependent shape: safe to capture in a CUDA graph; E/K times the FLOPs of the routed rows).
- `cpu_decode`:   one or two routes on CPU in eager mode: each runs straight on its token's row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.utils import logging

logger = logging.get_logger(__name__)

# torch.nn.functional.grouped_mm first ships in this release: the floor in pyproject.toml
GROUPED_MM_MIN_TORCH = "2.10"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# without gradients and in eager mode, `all_experts` up to this many tokens (decoding batches): there the step
# reads every expert's weights anyway, so computing every expert costs little; beyond it the loop's sync is cheaper.
# Under torch.compile (which a CUDA graph may capture: no sync allowed) up to the larger bound, which any decoding
# batch meets, while a compiled evaluation of long batches keeps its E * T * (2I + H) activations off the card.
ALL_EXPERTS_MAX_TOKENS = 64
ALL_EXPERTS_MAX_TOKENS_COMPILED = 1024


@dataclass(frozen=True)
class Capability:
    """One row of the table; a field left None matches anything."""

    implementation: str
    syncs: bool | None  # waits for the device (None: runs on the host, nothing to wait for)
    devices: tuple[str, ...] | None = None
    sm_majors: tuple[int, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    compiled: bool | None = None
    grad: bool | None = None
    max_tokens: int | None = None
    max_routes: int | None = None
    kernel: bool = False  # needs torch's grouped_mm: present in this torch, rows a multiple of 16 bytes
    note: str = ""

    def matches(self, device, sm, dtype, compiled, grad, tokens, routes, kernel_ok) -> bool:
        return (
            (self.devices is None or device in self.devices)
            and (self.sm_majors is None or (sm is not None and sm[0] in self.sm_majors))
            and (self.dtypes is None or dtype in self.dtypes)
            and (self.compiled is None or compiled == self.compiled)
            and (self.grad is None or grad == self.grad)
            and (self.max_tokens is None or tokens <= self.max_tokens)
            and (self.max_routes is None or routes <= self.max_routes)
            and (not self.kernel or kernel_ok)
        )


CAPABILITIES: tuple[Capability, ...] = (
    Capability("cpu_decode", None, ("cpu",), compiled=False, grad=False, max_routes=2, note="batch-1 decoding"),
    Capability("index_kernel", None, ("cpu",), dtypes=_KERNEL_DTYPES, compiled=False, kernel=True),
    Capability("index_kernel", None, ("cpu",), dtypes=(torch.bfloat16,), compiled=True, kernel=True,
               note="the kernel's compiled form takes bf16 only"),
    Capability("index_loop", None, ("cpu",), note="float64, unaligned sizes, compiled non-bf16"),
    Capability("index_kernel", False, ("cuda",), sm_majors=(9, 10), dtypes=(torch.bfloat16,), kernel=True,
               note="H100, H200, B200, B300"),
    Capability("index_kernel", False, ("meta",), dtypes=(torch.bfloat16,), kernel=True,
               note="tests' stand-in for sm90"),
    Capability("all_experts", False, grad=False, compiled=True, max_tokens=ALL_EXPERTS_MAX_TOKENS_COMPILED,
               note="CUDA-graph safe decoding"),
    Capability("all_experts", False, grad=False, max_tokens=ALL_EXPERTS_MAX_TOKENS, note="decoding"),
    Capability("index_loop", True, note="A100, L4, L40, RTX; fp32, fp16 on any GPU: 1 sync per grouped GEMM"),
)


def capability(device: str, sm, dtype, compiled: bool, grad: bool, tokens: int, routes: int, aligned: bool):
    """The first row of `CAPABILITIES` that matches."""
    kernel_ok = aligned and hasattr(F, "grouped_mm")
    return next(r for r in CAPABILITIES if r.matches(device, sm, dtype, compiled, grad, tokens, routes, kernel_ok))


def aligned(dtype: torch.dtype, *sizes: int) -> bool:
    """torch's grouped_mm stride rule: every matrix row a multiple of 16 bytes."""
    return all(size * dtype.itemsize % 16 == 0 for size in sizes)


# device types with an autocast state, asked once at import: `torch.amp.is_autocast_available` is a builtin that
# torch 2.11's Dynamo cannot trace (a graph break in every MoE layer), while the two calls below it folds
_AUTOCAST_DEVICES = tuple(d for d in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia") if torch.amp.is_autocast_available(d))


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """autocast's compute dtype where it is on for `device_type`, else None."""
    if device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def device_capability(device: torch.device):
    """(major, minor) of a CUDA device, None elsewhere."""
    return _cuda_capability(device) if device.type == "cuda" else None


@torch.compiler.assume_constant_result  # read once while tracing: torch.compile does not fold this CUDA query itself
def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def grouped_kernel_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `x [N, in] @ w [E, in, out]` runs on torch's grouped GEMM kernel here (the table's `index_kernel`
    rows, gradients on): decided from shapes, dtypes and the device alone, never by trying."""
    if x.dtype != w.dtype:
        return False
    ok = aligned(x.dtype, w.shape[1], w.shape[2])
    row = capability(x.device.type, device_capability(x.device), x.dtype, torch.compiler.is_compiling(), True,
                     x.shape[0], x.shape[0], ok)
    return row.implementation == "index_kernel"


def warn_if_no_grouped_mm() -> None:
    if not hasattr(F, "grouped_mm"):
        logger.warning_once(
            f"torch {torch.__version__} has no torch.nn.functional.grouped_mm (torch>={GROUPED_MM_MIN_TORCH}): the "
            "experts run as a per-expert loop that reads its offsets on the host (one device sync per grouped GEMM). "
            f"Install torch>={GROUPED_MM_MIN_TORCH} for the kernel."
        )


def capability_table() -> str:
    """`CAPABILITIES` as the markdown table docs/gpu.md quotes."""

    def names(values, fmt=str):
        return "any" if values is None else ", ".join(fmt(v) for v in values)

    lines = ["| device | sm | dtype | mode | gradients | tokens | implementation | host sync |",
             "|---|---|---|---|---|---|---|---|"]
    for r in CAPABILITIES:
        mode = "any" if r.compiled is None else ("compiled" if r.compiled else "eager")
        grad = "any" if r.grad is None else ("training" if r.grad else "none")
        tokens = f"<= {r.max_tokens}" if r.max_tokens else (f"<= {r.max_routes} routes" if r.max_routes else "any")
        syncs = "host (CPU)" if r.syncs is None else ("yes" if r.syncs else "no")
        dtypes = names(r.dtypes, lambda d: str(d).removeprefix("torch."))
        sm = names(r.sm_majors, lambda m: f"{m}.x")
        implementation = f"`{r.implementation}`" + (f" ({r.note})" if r.note else "")
        cells = (names(r.devices), sm, dtypes, mode, grad, tokens, implementation, syncs)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the grouped GEMMs: y[rows of e] = x[rows of e] @ w[e] for the contiguous row blocks ending at `offsets` ----


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, kernel: bool) -> torch.Tensor:
    """x [N, in], w [E, in, out] (any strides), offsets int32 [E] -> [N, out]. Rows past `offsets[-1]` are left
    undefined (the caller never reads them). `kernel`: torch's grouped_mm with its own autograd (weight gradients in
    the parameter's layout, nothing masked), else the per-expert loop."""
    if kernel:
        return F.grouped_mm(x, w, offs=offsets)
    return torch.ops.hf_ppmoe.grouped_mm_loop(x, w, offsets)


# The loop is a custom operator so that torch.compile sees one opaque node (no graph break) while it reads the
# offsets on the host. Its backward is a custom operator too, so autograd never looks inside the loop; it writes
# zeros wherever no row contributes (empty experts, rows past the last offset).


@torch.library.custom_op("hf_ppmoe::grouped_mm_loop", mutates_args=())
def _grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    y = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for e, end in enumerate(offsets.tolist()):  # one host read of E offsets per call
        if end > start:
            torch.mm(x[start:end], w[e], out=y[start:end])
        start = end
    return y


def _reads_the_host(offsets: torch.Tensor) -> None:
    """The fake kernels below also serve the `meta` device (the tests' stand-in for a GPU): there a host read must
    raise, as `.tolist()` would. Under torch.compile they see FakeTensors, whose device is the real one."""
    if offsets.device.type == "meta":
        raise RuntimeError("hf_ppmoe::grouped_mm_loop reads its offsets on the host, which meta tensors cannot give")


@_grouped_mm_loop.register_fake
def _(x, w, offsets):
    _reads_the_host(offsets)
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
    _reads_the_host(offsets)
    return torch.empty_like(x), torch.empty_like(w)


def _grouped_mm_loop_setup(ctx, inputs, output):
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _grouped_mm_loop_grad(ctx, grad):
    x, w, offsets = ctx.saved_tensors
    grad_x, grad_w = torch.ops.hf_ppmoe.grouped_mm_loop_backward(x, w, offsets, grad.contiguous())
    return grad_x, grad_w, None


_grouped_mm_loop.register_autograd(_grouped_mm_loop_grad, setup_context=_grouped_mm_loop_setup)
