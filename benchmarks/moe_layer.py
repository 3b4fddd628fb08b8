"""MoE layer speed against a dense FFN of the same active FLOPs and against Transformers' own MoE blocks.

    python benchmarks/moe_layer.py [--tokens 4096 --hidden 512 --inner 2048 --rounds 7]

For every (E, k) case all implementations run interleaved in one process, round after round; each round times every
implementation once (forward+backward, and forward only under no_grad) and divides by the dense FFN's time in
that same round; the reported number is the median of those per-round ratios (< 1 is faster than dense).

- dense: the same FFN with inner size k * f (equal active FLOPs to k experts of inner size f).
- ours-index / ours-einsum: `hf_ppmoe.moe.MoELayer` with experts_implementation "index" (PPMoE) / "einsum" (GShard).
- experts-only: the expert work of ours-index alone: the same grouped GEMMs (this batch's routing, tokens already
  grouped by expert), without gate, sort, gather, weighting and scatter. It is the floor of the
  `index` layer on this machine: what the per-expert GEMMs cost against the dense FFN's large ones.
- mixtral-eager / mixtral-grouped_mm: Transformers' MixtralSparseMoeBlock with that experts implementation.
- switch-hf: Transformers' SwitchTransformersSparseMLP (top-1 only, ReLU experts, capacity = all tokens) against
  ours with the same plain ReLU experts ("ours-index-relu") and a ReLU dense FFN.
Gated (SwiGLU) experts everywhere else. All routing is dropless, float32.
First line printed: operators per MoE layer (forward+backward, torch.profiler) for E = 8, 32, 128.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from transformers import MixtralConfig, SwitchTransformersConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersSparseMLP

from hf_ppmoe import GPTMoEConfig
from hf_ppmoe.moe import MLP, MoELayer
from hf_ppmoe.moe.experts import _parameters
from hf_ppmoe.moe.kernels import grouped_kernel_available, grouped_mm


def init_(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module


def ours(hidden, inner, E, k, implementation, gated=True):
    config = GPTMoEConfig(
        hidden_size=hidden, intermediate_size=inner, num_attention_heads=8, num_experts=E, num_experts_per_tok=k,
        router_type="topk" if gated else "switch", experts_implementation=implementation, gated_mlp=gated,
        hidden_act="silu" if gated else "relu",
    )
    layer = MoELayer(config)
    return lambda x: layer(x)[0], layer


def experts_only(layer: MoELayer, x: torch.Tensor):
    """The experts of `layer` on x's tokens as its gate routes them, pre-grouped by expert (see the module docstring)."""
    experts = layer.experts
    with torch.no_grad():
        flat = x.reshape(-1, x.shape[-1])
        ids = layer.gate(flat).expert_ids.reshape(-1)
        sorted_ids, order = torch.sort(ids, stable=True)
        offsets = torch.bincount(ids, minlength=experts.num_experts).cumsum(0).to(torch.int32)
        grouped = flat.index_select(0, order // layer.gate.top_k)

    def run(_):
        w_in, _b, w_out, _b = _parameters(experts, x.dtype)
        g = grouped.requires_grad_(torch.is_grad_enabled())
        kernel = grouped_kernel_available(g, w_in)
        return grouped_mm(experts._activate(grouped_mm(g, w_in, offsets, kernel)), w_out, offsets, kernel)

    return run, layer


def operators_per_layer(E: int, k: int, args) -> int:
    """Top-level aten operators one forward+backward of our index layer issues (torch.profiler): on a GPU each is at
    least one kernel launch. Device-independent; constant in E when no part of the layer loops over experts."""
    fn, layer = ours(args.hidden, args.inner, E, k, "index")
    x = torch.randn(1, 256, args.hidden, requires_grad=True)
    fn(x).sum().backward()  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(x).sum().backward()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def dense(hidden, inner, gated=True):
    config = GPTMoEConfig(
        hidden_size=hidden, intermediate_size=inner, num_attention_heads=8, gated_mlp=gated,
        hidden_act="silu" if gated else "relu",
    )
    mlp = init_(MLP(config))
    return mlp, mlp


def mixtral(hidden, inner, E, k, implementation):
    config = MixtralConfig(hidden_size=hidden, intermediate_size=inner, num_local_experts=E, num_experts_per_tok=k)
    config._experts_implementation = implementation
    block = init_(MixtralSparseMoeBlock(config))
    return block, block


def switch_hf(hidden, inner, E, tokens):
    config = SwitchTransformersConfig(
        d_model=hidden, d_ff=inner, num_experts=E, expert_capacity=tokens, router_jitter_noise=0.0
    )
    block = init_(SwitchTransformersSparseMLP(config))
    return block, block


def timed(fn, module, x, train: bool) -> float:
    if train:
        module.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        start = time.perf_counter()
        out = fn(xi)
        out.backward(torch.ones_like(out))  # a materialised gradient (a sum's is a stride-0 view grouped_mm refuses)
    else:
        with torch.no_grad():
            start = time.perf_counter()
            fn(x)
    return time.perf_counter() - start


def run_case(E, k, args):
    T, H, f = args.tokens, args.hidden, args.inner
    x = torch.randn(1, T, H)
    ours_index = ours(H, f, E, k, "index")
    impls = {
        "dense": dense(H, k * f),
        "ours-index": ours_index,
        "ours-einsum": ours(H, f, E, k, "einsum"),
        "experts-only": experts_only(ours_index[1], x),
        "mixtral-eager": mixtral(H, f, E, k, "eager"),
        "mixtral-grouped_mm": mixtral(H, f, E, k, "grouped_mm"),
    }
    if k == 1:
        impls |= {
            "dense-relu": dense(H, f, gated=False),
            "ours-index-relu": ours(H, f, E, 1, "index", gated=False),
            "switch-hf": switch_hf(H, f, E, T),
        }
    results = {}
    for train in (True, False):
        ratios = {name: [] for name in impls}
        for name, (fn, module) in impls.items():  # warm-up
            timed(fn, module, x, train)
        for _ in range(args.rounds):
            times = {name: timed(fn, module, x, train) for name, (fn, module) in impls.items()}
            for name in impls:
                base = times["dense-relu"] if name in ("ours-index-relu", "switch-hf") else times["dense"]
                ratios[name].append(times[name] / base)
        results["train" if train else "forward"] = {n: statistics.median(r) for n, r in ratios.items()}
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--inner", type=int, default=2048)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--topk", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--op_count_experts", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"T={args.tokens} H={args.hidden} f={args.inner} float32 threads={args.threads} rounds={args.rounds}; "
          "median per-round time ratio vs the dense FFN of equal active FLOPs (switch rows: vs ReLU dense)")
    print("operators per layer (forward+backward, top-level aten): " + ", ".join(
        f"E={E} k={k}: {operators_per_layer(E, k, args)}" for E in args.op_count_experts for k in args.topk))
    names = None
    for E in args.experts:
        for k in args.topk:
            res = run_case(E, k, args)
            if names is None:
                names = [n for n in res["train"] if n not in ("dense", "dense-relu")]
                print("| E | k | mode | " + " | ".join(names) + " |")
                print("|---|---|---|" + "---|" * len(names))
            for mode, row in res.items():
                print(f"| {E} | {k} | {mode} | " + " | ".join(f"{row[n]:.2f}" if n in row else "n/a" for n in names) + " |")


if __name__ == "__main__":
    main()
