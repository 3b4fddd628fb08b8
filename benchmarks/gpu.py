"""GPU benchmarks (bf16, CUDA events, median of interleaved rounds): MoE layer, whole training step, greedy decoding.

    python benchmarks/gpu.py [--quick] [--out results.md]            # needs CUDA; --quick: smaller shapes, fewer rounds
    python benchmarks/gpu.py --device cpu --quick                    # smoke run of the same code on CPU (no numbers)

Every section runs its variants interleaved, round after round, and reports the median of per-round ratios to the
baseline of the same round (dense FFN / dense backbone), so clock and thermal drift cancel:

1. MoE layer, training (forward+backward) and forward: ours (`MoELayer`, `index` dispatch = grouped GEMMs) against a
   dense SwiGLU FFN of equal active FLOPs (inner size k * f) and Transformers' Qwen3-MoE sparse block with its
   `grouped_mm` and `batched_mm` experts, for E in {8, 32, 128}, k in {1, 2, 8}; 16k tokens, hidden 2048.
2. GPT-MoE training step (AdamW, bf16 weights, torch.compile) tokens/s and MFU against its dense backbone (the same
   model with every FFN dense and k * f wide: equal active FLOPs).
3. Greedy decoding tokens/s with a static cache and the compiled decode step, batch 1 and 32, against the dense
   backbone and Transformers' Qwen3-MoE of the same shape and weights layout.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
from hf_ppmoe.moe import MLP, MoELayer

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16 tensor-core peaks


class Timer:
    """Elapsed milliseconds of fn(): CUDA events on a GPU, wall clock on CPU (smoke runs)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        import time

        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3


def interleaved(variants: dict, baseline: str, timer: Timer, rounds: int, warmup: int = 2) -> dict:
    """{name: (median ms, median ratio to baseline)} over rounds that run every variant once each."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(timer(fn))
    return {
        name: (statistics.median(t), statistics.median(a / b for a, b in zip(t, times[baseline])))
        for name, t in times.items()
    }


def moe_config(hidden, inner, E, k, layers=1, **kw):
    return GPTMoEConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=inner, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 512),
        num_experts=E, num_experts_per_tok=k, router_type="topk", norm_topk_prob=True, moe_layer_frequency=1,
        max_position_embeddings=4096, **kw,
    )


def layer_section(args, device, dtype, timer):
    T, H, f = args.tokens, args.hidden, args.inner
    rows = []
    for E in args.experts:
        for k in args.topk:
            torch.manual_seed(0)
            x = torch.randn(1, T, H, device=device, dtype=dtype)  # [B, S, H]: Transformers' blocks take 3-D input
            ours = MoELayer(moe_config(H, f, E, k)).to(device, dtype)
            dense = MLP(moe_config(H, k * f, 1, 1)).to(device, dtype)
            variants = {"dense": dense, "ours": lambda x, m=ours: m(x)[0]}
            for impl in ("grouped_mm", "batched_mm"):
                qcfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=f, num_experts=E, num_experts_per_tok=k,
                                      norm_topk_prob=True)
                qcfg._experts_implementation = impl
                block = Qwen3MoeSparseMoeBlock(qcfg).to(device, dtype)
                with torch.no_grad():  # a bare block is not initialised (zeros: every token would pick the same experts)
                    for p in block.parameters():
                        p.normal_(0.0, 0.02)
                variants[f"qwen3-{impl}"] = block
            modules = [m for m in (ours, dense, *[v for v in variants.values() if isinstance(v, torch.nn.Module)])]

            def train_step(fn, x=x):
                xi = x.detach().requires_grad_(True)
                out = fn(xi)
                out = out[0] if isinstance(out, tuple) else out
                out.backward(torch.ones_like(out))  # a materialised gradient, the same for every variant

            def fwd(fn, x=x):
                with torch.no_grad():
                    fn(x)

            for mode, step in (("train", train_step), ("forward", fwd)):
                res = interleaved({n: (lambda fn=fn: step(fn)) for n, fn in variants.items()}, "dense", timer, args.rounds)
                rows.append((E, k, mode, {n: r for n, (_, r) in res.items() if n != "dense"}, res["dense"][0]))
            for m in modules:
                m.zero_grad(set_to_none=True)
            del ours, dense, variants, modules
    names = ["ours", "qwen3-grouped_mm", "qwen3-batched_mm"]
    lines = [f"### MoE layer vs dense FFN of equal active FLOPs (T={T}, H={H}, f={f}, {dtype})", "",
             "| E | k | mode | dense ms | " + " | ".join(names) + " |", "|---|---|---|---|" + "---|" * len(names)]
    lines += [f"| {E} | {k} | {mode} | {ms:.2f} | " + " | ".join(f"{r[n]:.2f}x" for n in names) + " |"
              for E, k, mode, r, ms in rows]
    return lines


def flops_per_token(config, dense: bool) -> float:
    """6 * active parameters per token (matmul weights; attention scores left out)."""
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    kv = config.num_key_value_heads * (H // config.num_attention_heads)
    attn = H * H * 2 + 2 * H * kv
    ffn = 3 * H * config.intermediate_size * (1 if dense else config.num_experts_per_tok)
    return 6.0 * (L * (attn + ffn) + H * V)


def training_section(args, device, dtype, timer):
    H, f, E, k, L = args.model_hidden, args.model_inner, 8, 2, args.model_layers
    B, S = args.batch, args.seq
    models = {
        "dense backbone": moe_config(H, k * f, 1, 1, layers=L, moe_layers=[]),
        "GPT-MoE E=8 k=2": moe_config(H, f, E, k, layers=L),
    }
    ids = torch.randint(0, 32000, (B, S), device=device)
    variants, configs = {}, {}
    for name, config in models.items():
        torch.manual_seed(0)
        model = GPTMoEForCausalLM(config).to(device, dtype).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        compiled = torch.compile(model) if args.compile else model

        def step(m=compiled, o=optimizer):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)

        variants[name], configs[name] = step, config
    res = interleaved(variants, "dense backbone", timer, args.rounds)
    peak = next((v for n, v in PEAK_BF16_TFLOPS.items() if device.type == "cuda" and n in torch.cuda.get_device_name()), None)
    lines = [f"### Training step (B={B}, S={S}, H={H}, f={f}, {L} layers, AdamW, compile={args.compile})", "",
             "| model | ms/step | tokens/s | vs dense | MFU |", "|---|---|---|---|---|"]
    for name, (ms, ratio) in res.items():
        tps = B * S / (ms / 1e3)
        mfu = f"{flops_per_token(configs[name], name.startswith('dense')) * tps / (peak * 1e12):.1%}" if peak else "n/a"
        lines.append(f"| {name} | {ms:.1f} | {tps:,.0f} | {1 / ratio:.2f}x | {mfu} |")
    return lines


def decode_section(args, device, dtype, timer):
    H, f, E, k, L = args.model_hidden, args.model_inner, 8, 2, args.model_layers
    new_tokens = args.new_tokens
    lines = [f"### Greedy decoding, static cache + compiled decode step ({new_tokens} new tokens, {L} layers, H={H})", "",
             "| batch | model | tokens/s | vs dense |", "|---|---|---|---|"]
    for B in args.decode_batches:
        ids = torch.randint(0, 32000, (B, 16), device=device)
        variants = {}
        qcfg = Qwen3MoeConfig(vocab_size=32000, hidden_size=H, moe_intermediate_size=f, intermediate_size=k * f,
                              num_hidden_layers=L, num_attention_heads=max(1, H // 128),
                              num_key_value_heads=max(1, H // 512), num_experts=E, num_experts_per_tok=k,
                              norm_topk_prob=True)
        qcfg._experts_implementation = "grouped_mm"
        builders = {
            "dense backbone": lambda: GPTMoEForCausalLM(moe_config(H, k * f, 1, 1, layers=L, moe_layers=[])),
            "GPT-MoE": lambda: GPTMoEForCausalLM(moe_config(H, f, E, k, layers=L)),
            "Qwen3-MoE grouped_mm": lambda: Qwen3MoeForCausalLM(qcfg),
        }
        for name, build in builders.items():
            torch.manual_seed(0)
            model = build().to(device, dtype).eval()
            kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            if args.compile:
                kwargs["cache_implementation"] = "static"
            variants[name] = lambda m=model, kw=kwargs: m.generate(ids, **kw)
        res = interleaved(variants, "dense backbone", timer, max(3, args.rounds // 2), warmup=2)
        for name, (ms, ratio) in res.items():
            lines.append(f"| {B} | {name} | {B * new_tokens / (ms / 1e3):,.0f} | {1 / ratio:.2f}x |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer rounds")
    parser.add_argument("--sections", nargs="+", default=["layer", "training", "decode"])
    parser.add_argument("--no_compile", dest="compile", action="store_false")
    parser.add_argument("--out", help="also write the markdown tables to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (none found). For a smoke run of the code on CPU: --device cpu --quick")
    q = args.quick or device.type == "cpu"
    args.tokens, args.hidden, args.inner = (512, 256, 176) if q else (16384, 2048, 1408)
    args.experts, args.topk = ([8, 32], [1, 2]) if q else ([8, 32, 128], [1, 2, 8])
    args.model_hidden, args.model_inner, args.model_layers = (256, 176, 2) if q else (2048, 1408, 8)
    args.batch, args.seq = (2, 128) if q else (8, 2048)
    args.decode_batches, args.new_tokens = ([1, 4], 8) if q else ([1, 32], 128)
    args.rounds = 3 if q else 10
    dtype = torch.bfloat16
    timer = Timer(device)
    header = torch.cuda.get_device_name() if device.type == "cuda" else "CPU smoke run (not a measurement)"
    out = [f"## benchmarks/gpu.py on {header}, torch {torch.__version__}", ""]
    print(out[0], flush=True)
    sections = {"layer": layer_section, "training": training_section, "decode": decode_section}
    for name in args.sections:
        lines = sections[name](args, device, dtype, timer) + [""]
        print("\n".join(lines), flush=True)
        out += lines
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
