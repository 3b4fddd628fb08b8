"""The CPU proxy of the GPU layer benchmark: kernels launched, GEMM FLOPs and the bytes every other kernel reads and
writes, per MoE-layer training step (forward + backward) and forward, counted on PyTorch's `meta` device at
benchmarks/gpu.py's shapes (T=16384 tokens, H=2048, f=1408, bf16) for ours and Transformers' Qwen3-MoE block.

    python benchmarks/traffic.py [--experts 8 32 128] [--topk 1 2 8] [--out table.md]

Nothing is computed (meta tensors carry shapes only), so it runs in seconds on a CPU whatever the shapes. Every aten
operator that reaches the dispatcher is one kernel, except views and allocations (which launch none on a GPU).
GEMMs (mm, addmm, bmm, grouped_mm) count FLOPs (a grouped GEMM as if every row were routed: dropless); every other
kernel counts the bytes of its tensor arguments read and its outputs written; an indexed in-place kernel (index_put_,
index_fill_, scatter_, ...) reads its index and source and the elements of its target they name. Both layers train
as benchmarks/gpu.py trains them: `out.backward(ones)` from a leaf input.

What it cannot see: fusion inside a kernel (a GPU kernel may read a tensor twice from cache), launch latency, and
the GEMMs' own efficiency. It holds the line between GPU runs; the GPU decides (benchmarks/gpu.py).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
GiB = 2**30
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._grouped_mm.default}
ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
               aten.new_empty_strided.default}


@dataclass
class Counts:
    kernels: int = 0
    gemm_flops: float = 0.0
    other_bytes: float = 0.0
    ops: dict = field(default_factory=dict)  # aten name -> kernels

    def row(self) -> str:
        return f"{self.kernels} | {self.gemm_flops / 1e12:.2f} | {self.other_bytes / GiB:.2f}"


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# in-place kernels that touch only the indexed elements of their target: they read their index (and source) and read
# and write the target's elements it names, not the whole target
INDEXED_INPLACE = {aten.index_fill_.int_Scalar, aten.index_put_.default, aten.index_copy_.default,
                   aten.index_add_.default, aten.scatter_.src, aten.scatter_.value, aten.scatter_add_.default}


def indexed_inplace_bytes(func, args) -> int:
    self = args[0]
    if func is aten.index_put_.default:  # (indices, values, accumulate): whole rows of the first indexed dim
        index, values = args[1][0], args[2]
        touched = index.numel() * math.prod(self.shape[1:])
        return _bytes([index, values]) + 2 * touched * self.element_size()
    dim, index = args[1], args[2]
    source = [t for t in _tensors(args[3:])]
    if func in (aten.scatter_.src, aten.scatter_.value, aten.scatter_add_.default):  # one element per index entry
        touched = index.numel()
    else:  # index_fill_, index_copy_, index_add_: whole slices along dim
        touched = index.numel() * self.numel() // max(1, self.shape[dim])
    return _bytes([index, *source]) + 2 * touched * self.element_size()


def gemm_flops(func, args) -> float:
    """2 x multiply-adds of one GEMM from its arguments' shapes."""
    if func is aten.mm.default:
        (m, k), n = args[0].shape, args[1].shape[1]
        return 2.0 * m * k * n
    if func is aten.addmm.default:
        (m, k), n = args[1].shape, args[2].shape[1]
        return 2.0 * m * k * n
    if func in (aten.bmm.default, aten.baddbmm.default):
        a, b = (args[0], args[1]) if func is aten.bmm.default else (args[1], args[2])
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    a, b = args[0], args[1]  # grouped: 2d x 3d (rows split by offsets), 2d x 2d (reduction split), 3d x 3d
    if a.dim() == 2 and b.dim() == 3:
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2.0 * math.prod(a.shape) * b.shape[-1]


class Traffic(TorchDispatchMode):
    """Counts what runs inside `with Traffic() as t:` into `t.counts`."""

    def __init__(self):
        super().__init__()
        self.counts = Counts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in ALLOCATIONS or _is_view(func) or func is aten.detach.default:
            return out
        c = self.counts
        c.kernels += 1
        name = func.__name__
        c.ops[name] = c.ops.get(name, 0) + 1
        if func in GEMMS:
            c.gemm_flops += gemm_flops(func, args)
        elif func in INDEXED_INPLACE:
            c.other_bytes += indexed_inplace_bytes(func, args)
        else:
            c.other_bytes += _bytes(_tensors((args, kwargs))) + _bytes(_tensors(out))
        return out


def count(fn) -> Counts:
    with Traffic() as t:
        fn()
    return t.counts


# ---- the two layers at the GPU benchmark's shapes, built on the meta device ----


def ours(H: int, f: int, E: int, k: int, dtype=torch.bfloat16, losses: bool | None = None):
    """`MoELayer` as benchmarks/gpu.py builds it; `losses=False` leaves out the router losses and statistics (which
    it computes by default with gradients) to count what they cost."""
    from hf_ppmoe import GPTMoEConfig
    from hf_ppmoe.moe import MoELayer

    config = GPTMoEConfig(hidden_size=H, intermediate_size=f, num_attention_heads=max(1, H // 128), num_experts=E,
                          num_experts_per_tok=k, router_type="topk", norm_topk_prob=True, moe_layer_frequency=1)
    with torch.device("meta"):
        layer = MoELayer(config).to(dtype)
    return lambda x: layer(x, compute_losses=losses)[0]


def qwen3(H: int, f: int, E: int, k: int, dtype=torch.bfloat16):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=f, num_experts=E, num_experts_per_tok=k,
                            norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        block = Qwen3MoeSparseMoeBlock(config).to(dtype)
    return block


LAYERS = {"ours": ours, "qwen3-grouped_mm": qwen3}


def count_train(layer, T: int, H: int, dtype=torch.bfloat16) -> Counts:
    """forward + backward of one layer on a [1, T, H] meta input, as benchmarks/gpu.py trains it."""
    x = torch.empty(1, T, H, device="meta", dtype=dtype, requires_grad=True)

    def train():
        out = layer(x)
        out.backward(torch.ones_like(out))

    return count(train)


def measure(layer, T: int, H: int, dtype=torch.bfloat16) -> dict[str, Counts]:
    """{"train": forward + backward, "forward": under no_grad} of one layer on a [1, T, H] meta input."""
    x = torch.empty(1, T, H, device="meta", dtype=dtype)

    def forward():
        with torch.no_grad():
            layer(x)

    return {"train": count_train(layer, T, H, dtype), "forward": count(forward)}


def table(experts=(8, 32, 128), topk=(1, 2, 8), T=16384, H=2048, f=1408) -> tuple[list[str], dict]:
    """The markdown table and the raw counts {(E, k, mode, layer): Counts}."""
    results = {}
    lines = [f"### Per MoE layer on the meta device (T={T}, H={H}, f={f}, bf16)", "",
             "Non-GEMM GiB: read + written by every kernel but the GEMMs. Ours trains with its router losses and "
             "statistics (the kernels they take in brackets); Qwen3-MoE's block computes none (its model adds the aux "
             "loss once from all layers' logits).", "",
             "| E | k | mode | ours kernels | ours GEMM TFLOP | ours non-GEMM GiB | qwen3 kernels | qwen3 GEMM TFLOP | "
             "qwen3 non-GEMM GiB | kernels ours / qwen3 | non-GEMM bytes ours / qwen3 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for E in experts:
        for k in topk:
            per_layer = {name: measure(build(H, f, E, k), T, H) for name, build in LAYERS.items()}
            without = count_train(ours(H, f, E, k, losses=False), T, H).kernels
            losses = per_layer["ours"]["train"].kernels - without
            for mode in ("train", "forward"):
                a, b = per_layer["ours"][mode], per_layer["qwen3-grouped_mm"][mode]
                results.update({(E, k, mode, "ours"): a, (E, k, mode, "qwen3-grouped_mm"): b})
                results[(E, k, "router losses")] = losses
                mine = a.row().replace(" |", f" ({losses}) |", 1) if mode == "train" else a.row()  # kernels (losses)
                lines.append(f"| {E} | {k} | {mode} | {mine} | {b.row()} | {a.kernels / b.kernels:.2f} | "
                             f"{a.other_bytes / b.other_bytes:.2f} |")
    return lines, results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--topk", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--ops", action="store_true", help="also list the kernels of each case by aten operator")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    lines, results = table(args.experts, args.topk, T=args.tokens)
    if args.ops:
        for (E, k, mode, name), c in ((key, c) for key, c in results.items() if len(key) == 4):
            lines.append(f"\nE={E} k={k} {mode} {name}: " + ", ".join(f"{op} x{n}" for op, n in sorted(c.ops.items())))
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    main()
