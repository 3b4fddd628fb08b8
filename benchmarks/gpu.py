"""GPU benchmarks (bf16, CUDA events, median of interleaved rounds): MoE layer, whole training step, greedy decoding.

    python benchmarks/gpu.py [--quick] [--out results.md]            # needs CUDA; --quick: smaller shapes, fewer rounds
    python benchmarks/gpu.py --device cpu --quick                    # smoke run of the same code on CPU (no numbers)
    python benchmarks/gpu.py --plan                                  # no GPU: every case, its memory estimate, and
                                                                     # what an 80 GB and a 141 GB card would skip

Every case is sized against the device's memory before it runs (`estimate_*`: weights, gradients, optimizer state,
the activations autograd keeps, and Transformers' `batched_mm` per-route weight copies); one that cannot fit is
skipped with the reason in its table row instead of ending the run out of memory.

Every section runs its variants interleaved, round after round, and reports the median of per-round ratios to the
baseline of the same round (dense FFN / dense backbone), so clock and thermal drift cancel:

1. MoE layer, training (forward+backward) and forward: ours (`MoELayer`, `index` experts implementation = grouped GEMMs) against a
   dense SwiGLU FFN of equal active FLOPs (inner size k * f) and Transformers' Qwen3-MoE sparse block with its
   `grouped_mm` and `batched_mm` experts, for E in {8, 32, 128}, k in {1, 2, 8}; 16k tokens, hidden 2048.
2. GPT-MoE training step (AdamW, bf16 weights, torch.compile) tokens/s and MFU against its dense backbone (the same
   model with every FFN dense and k * f wide: equal active FLOPs) and Transformers' Qwen3-MoE model
   (`Qwen3MoeForCausalLM`, grouped_mm experts) of the same shape (H, layers, heads, E, k, expert size). MFU counts 6 x active matmul parameters plus
   attention's 12 x layers x hidden x sequence per token (PaLM, appendix B), against the dense bf16 peak of the card
   looked up by its name (`peak_bf16_tflops`: H100 SXM, PCIe and NVL differ); an unknown card gets no MFU.
3. Greedy decoding tokens/s with a static cache and the compiled decode step, batch 1 and 32, against the dense
   backbone and Transformers' Qwen3-MoE of the same shape and weights layout.

Sections 2 and 3 compile, so their variants run one after another, each after `torch._dynamo.reset()` (no variant
reuses or evicts another's compiled code), and each reports the graphs Dynamo compiled and the graph breaks it met:
a compiled training step must be one graph and a compiled decode step must not recompile (the section's table is
written, then the run fails naming the variant). `scripts/gpu_check.sh` runs every section in a fresh process.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch._dynamo.utils import counters
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
from hf_ppmoe.moe import MLP, Experts, MoELayer

GiB = 2**30
# dense (not 2:4 sparse) bf16 tensor-core peaks from NVIDIA's data sheets, by a part of torch.cuda.get_device_name();
# the first match wins, so the more specific names come first
PEAK_BF16_TFLOPS = (
    ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0),  # "NVIDIA H100 80GB HBM3" is the SXM part
    ("H200 NVL", 835.0), ("H200", 989.0),  # GH200 included
    ("B200", 2250.0), ("A100", 312.0), ("A10G", 70.0), ("A10", 125.0),
    ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
)
# the share of a card's memory a case may plan for (allocator fragmentation, CUDA context, workspaces)
USABLE = 0.9


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the card `device_name` names, None for a card not in `PEAK_BF16_TFLOPS`."""
    return next((tflops for part, tflops in PEAK_BF16_TFLOPS if part in device_name), None)


def fits(needed: float, memory: float | None) -> str:
    """'' when `needed` bytes fit `memory` (None: no limit, CPU), else the reason to skip."""
    if memory is None or needed <= USABLE * memory:
        return ""
    return f"skipped: needs ~{needed / GiB:,.1f} GiB, {memory / GiB:,.1f} GiB card"


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


def qwen3_config(hidden, inner, E, k, layers):
    """Transformers' Qwen3-MoE of moe_config's shape (every layer sparse; intermediate_size only sizes
    `parameters`), with its grouped_mm experts."""
    config = Qwen3MoeConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=inner, moe_intermediate_size=inner,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 512),
        num_experts=E, num_experts_per_tok=k, norm_topk_prob=True, max_position_embeddings=4096,
    )
    config._experts_implementation = "grouped_mm"
    return config


def build_model(config):
    return Qwen3MoeForCausalLM(config) if isinstance(config, Qwen3MoeConfig) else GPTMoEForCausalLM(config)


def fresh_dynamo():
    """Forget every compiled graph and Dynamo's counters: the next variant compiles alone."""
    torch._dynamo.reset()
    counters.clear()


def dynamo_graphs() -> tuple[int, int]:
    """(graphs Dynamo compiled, graph breaks it met) since the last `fresh_dynamo()`."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def graph_problem(name: str, graphs: int, breaks: int, compiled: bool) -> str:
    """'' when a compiled variant is one graph without breaks (or nothing was compiled), else what went wrong.
    Transformers' Qwen3-MoE is a reference, not ours: its graphs are reported, never held against the run."""
    if not compiled or (graphs <= 1 and breaks == 0) or name.split()[1] == "Qwen3-MoE":
        return ""
    return (f"{name}: {graphs} graphs, {breaks} graph breaks under torch.compile (expected 1 graph, no break; "
            f"TORCH_LOGS=graph_breaks,recompiles shows where)")


def time_alone(fn, timer: Timer, rounds: int, warmup: int = 2) -> float:
    """Median ms of fn() over `rounds` calls after `warmup` (compilation included in the warm-up)."""
    for _ in range(warmup):
        fn()
    return statistics.median(timer(fn) for _ in range(rounds))


# ---- memory estimates (bytes; upper-bound style: what autograd keeps plus the largest transient) ----


def estimate_layer(variant: str, T: int, H: int, f: int, E: int, k: int, itemsize: int = 2) -> float:
    """One MoE-layer case of the layer section, forward+backward: weights and their gradients, the activations kept
    for backward, and for Transformers' `batched_mm` the per-route copy of the gate/up weights it gathers ([T*k, 2f, H])
    and that copy's gradient."""
    io = 3 * T * H  # input, its gradient, output
    if variant == "dense":
        return itemsize * (2 * 3 * H * k * f + io + 4 * T * k * f)
    routed = T * k * (2 * H + 4 * f)  # gathered rows, gate/up, activation, down output (+ the gate's [T, E] in fp32)
    total = itemsize * (2 * 3 * E * H * f + io + 2 * routed) + 4 * 3 * T * E
    if variant == "qwen3-batched_mm":
        total += 2 * itemsize * T * k * 2 * f * H
    return total


def parameters(config, dense: bool) -> tuple[int, int]:
    """(all, active per token) matmul parameters of a GPT-MoE (or its dense backbone), embeddings included."""
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    kv = config.num_key_value_heads * (H // config.num_attention_heads)
    attn = H * H * 2 + 2 * H * kv
    E, k = (1, 1) if dense else (config.num_experts, config.num_experts_per_tok)
    ffn = 3 * H * config.intermediate_size
    return L * (attn + E * ffn) + H * V * 2, L * (attn + k * ffn) + H * V


def estimate_training(config, dense: bool, B: int, S: int, itemsize: int = 2) -> float:
    """A training step with AdamW (states in the weights' dtype): weights, gradients, two optimizer states, the
    activations of every layer (34 * H per token and layer as in Korthikanti et al. 2022 with fused attention, plus
    the routed experts' rows), and the logits in bf16 and float32 for the loss."""
    total, _ = parameters(config, dense)
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    k = 1 if dense else config.num_experts_per_tok
    per_layer = 34 * H + 2 * k * (2 * H + 4 * config.intermediate_size) * itemsize
    return 4 * itemsize * total + B * S * (L * per_layer + V * (itemsize + 8))


def estimate_decoding(config, B: int, length: int, itemsize: int = 2) -> float:
    """Greedy decoding with a static cache: weights, the cache of `length` positions, one step's logits."""
    total, _ = parameters(config, config.num_experts == 1)
    kv = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    return itemsize * (total + 2 * config.num_hidden_layers * B * length * kv + B * config.vocab_size * 4)


def flops_per_token(config, dense: bool, seq_len: int) -> float:
    """Training FLOPs per token: 6 x active matmul parameters (the input embedding is a lookup) plus attention's
    scores and weighted sums, 12 x layers x hidden x sequence (PaLM, appendix B; no causal halving)."""
    _, active = parameters(config, dense)
    return 6.0 * active + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


LAYER_VARIANTS = ("dense", "ours", "qwen3-grouped_mm", "qwen3-batched_mm")


def layer_cases(args):
    """(E, k, {variant: estimated bytes})"""
    return [(E, k, {v: estimate_layer(v, args.tokens, args.hidden, args.inner, E, k) for v in LAYER_VARIANTS})
            for E in args.experts for k in args.topk]


def training_models(args):
    H, f, L = args.model_hidden, args.model_inner, args.model_layers
    return {
        "dense backbone": (moe_config(H, 2 * f, 1, 1, layers=L, moe_layers=[]), True),
        "GPT-MoE E=8 k=2": (moe_config(H, f, 8, 2, layers=L), False),
        "Qwen3-MoE E=8 k=2": (qwen3_config(H, f, 8, 2, L), False),
    }


ALL_EXPERTS = "GPT-MoE, all_experts"


def decode_models(args):
    H, f, L = args.model_hidden, args.model_inner, args.model_layers
    return {
        "dense backbone": moe_config(H, 2 * f, 1, 1, layers=L, moe_layers=[]),
        "GPT-MoE": moe_config(H, f, 8, 2, layers=L),
        # the same model with every expert run on every token (the CUDA-graph-safe decoding form of other GPUs): which
        # of the two decodes faster on this card decides the capability table's decoding rows
        ALL_EXPERTS: moe_config(H, f, 8, 2, layers=L),
        "Qwen3-MoE grouped_mm": qwen3_config(H, f, 8, 2, L),
    }


def plan(args, cards=(80e9, 141e9)) -> list[str]:
    """Every case of a full run with its memory estimate and what each card size would skip (no GPU needed)."""
    heads = " | ".join(f"{c / 1e9:.0f} GB card" for c in cards)
    lines = [f"### Plan (T={args.tokens}, H={args.hidden}, f={args.inner}; model H={args.model_hidden}, "
             f"{args.model_layers} layers; bf16)", "", f"| section | case | estimate GiB | {heads} |",
             "|---|---|---|" + "---|" * len(cards)]

    def row(section, case, needed):
        verdicts = " | ".join(fits(needed, c) or "runs" for c in cards)
        lines.append(f"| {section} | {case} | {needed / GiB:,.1f} | {verdicts} |")

    for E, k, needs in layer_cases(args):
        for variant, needed in needs.items():
            row("layer", f"E={E} k={k} {variant}", needed)
    for name, (config, dense) in training_models(args).items():
        row("training", f"{name} B={args.batch} S={args.seq}", estimate_training(config, dense, args.batch, args.seq))
    for B in args.decode_batches:
        for name, config in decode_models(args).items():
            row("decode", f"{name} batch {B}", estimate_decoding(config, B, 16 + args.new_tokens))
    return lines


def layer_section(args, device, dtype, timer):
    T, H, f = args.tokens, args.hidden, args.inner
    rows = []
    for E, k, needs in layer_cases(args):
        skipped = {v: fits(needed, args.memory) for v, needed in needs.items()}
        skipped = {v: why for v, why in skipped.items() if why}
        if "dense" in skipped or "ours" in skipped:
            rows.append((E, k, "train+forward", {n: skipped.get(n) or skipped.get("ours") or skipped["dense"]
                                                 for n in LAYER_VARIANTS[1:]}, float("nan")))
            continue
        torch.manual_seed(0)
        x = torch.randn(1, T, H, device=device, dtype=dtype)  # [B, S, H]: Transformers' blocks take 3-D input
        ours = MoELayer(moe_config(H, f, E, k)).to(device, dtype)
        dense = MLP(moe_config(H, k * f, 1, 1)).to(device, dtype)
        variants = {"dense": dense, "ours": lambda x, m=ours: m(x)[0]}
        for impl in ("grouped_mm", "batched_mm"):
            if f"qwen3-{impl}" in skipped:
                continue
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
            res = interleaved({n: (lambda fn=fn: step(fn)) for n, fn in variants.items()}, "dense", timer, args.rounds,
                              args.warmup)
            cells = {n: f"{r:.2f}x" for n, (_, r) in res.items() if n != "dense"}
            rows.append((E, k, mode, {**cells, **skipped}, res["dense"][0]))
        for m in modules:
            m.zero_grad(set_to_none=True)
        del ours, dense, variants, modules
        if device.type == "cuda":
            torch.cuda.empty_cache()
    names = list(LAYER_VARIANTS[1:])
    lines = [f"### MoE layer vs dense FFN of equal active FLOPs (T={T}, H={H}, f={f}, {dtype})", "",
             "| E | k | mode | dense ms | " + " | ".join(names) + " |", "|---|---|---|---|" + "---|" * len(names)]
    lines += [f"| {E} | {k} | {mode} | {ms:.2f} | " + " | ".join(r[n] for n in names) + " |"
              for E, k, mode, r, ms in rows]
    return lines


def training_section(args, device, dtype, timer, problems):
    """Each model alone after `fresh_dynamo()`: built, compiled, warmed up, timed, its graphs counted, freed."""
    B, S = args.batch, args.seq
    ids = torch.randint(0, 32000, (B, S), device=device)
    results, skipped = {}, {}
    for name, (config, dense) in training_models(args).items():
        why = fits(estimate_training(config, dense, B, S), args.memory)
        if why:
            skipped[name] = why
            continue
        fresh_dynamo()
        torch.manual_seed(0)
        model = build_model(config).to(device, dtype).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        compiled = torch.compile(model) if args.compile else model

        def step(m=compiled, o=optimizer):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)

        ms = time_alone(step, timer, args.rounds, args.warmup)
        graphs, breaks = dynamo_graphs()
        problems.append(graph_problem(f"training {name}", graphs, breaks, args.compile))
        results[name] = (ms, graphs, breaks, config, dense)
        print(f"training {name}: {ms:.1f} ms/step, {graphs} graphs / {breaks} breaks", flush=True)
        del model, optimizer, compiled, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    peak = peak_bf16_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    L, H, f = args.model_layers, args.model_hidden, args.model_inner
    lines = [f"### Training step (B={B}, S={S}, H={H}, f={f}, {L} layers, AdamW, compile={args.compile}; "
             f"peak {f'{peak:.0f} TFLOPS bf16' if peak else 'unknown for this card: no MFU'}; each model alone "
             f"after torch._dynamo.reset())", "",
             "| model | ms/step | tokens/s | vs dense | vs Qwen3-MoE | MFU | graphs / breaks |",
             "|---|---|---|---|---|---|---|"]
    base = {ref: results[ref][0] for ref in ("dense backbone", "Qwen3-MoE E=8 k=2") if ref in results}
    for name, (ms, graphs, breaks, config, dense) in results.items():
        tps = B * S / (ms / 1e3)
        mfu = f"{flops_per_token(config, dense, S) * tps / (peak * 1e12):.1%}" if peak else "n/a"
        vs = [f"{base[ref] / ms:.2f}x" if ref in base else "n/a" for ref in ("dense backbone", "Qwen3-MoE E=8 k=2")]
        lines.append(f"| {name} | {ms:.1f} | {tps:,.0f} | {vs[0]} | {vs[1]} | {mfu} | {graphs} / {breaks} |")
    lines += [f"| {name} | {why} | | | | | |" for name, why in skipped.items()]
    return lines


def decode_section(args, device, dtype, timer, problems):
    """Each model alone after `fresh_dynamo()` (Transformers compiles the static-cache decode step itself on CUDA):
    the decode step must compile once, not recompile per layer or per step."""
    H, L, new_tokens = args.model_hidden, args.model_layers, args.new_tokens
    how = "static cache + compiled decode step" if args.compile else "dynamic cache, eager (--no_compile)"
    lines = [f"### Greedy decoding, {how} ({new_tokens} new tokens, {L} layers, H={H}; "
             f"each model alone after torch._dynamo.reset())", "",
             "| batch | model | tokens/s | vs dense | graphs / breaks |", "|---|---|---|---|---|"]
    for B in args.decode_batches:
        ids = torch.randint(0, 32000, (B, 16), device=device)
        results = {}
        for name, config in decode_models(args).items():
            why = fits(estimate_decoding(config, B, 16 + new_tokens), args.memory)
            if why:
                lines.append(f"| {B} | {name} | {why} | | |")
                continue
            fresh_dynamo()
            torch.manual_seed(0)
            model = build_model(config).to(device, dtype).eval()
            if name == ALL_EXPERTS:
                for module in model.modules():
                    if isinstance(module, Experts):
                        module.config._experts_implementation = "all_experts"
            kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            if args.compile:
                kwargs["cache_implementation"] = "static"
            rounds = max(args.min_decode_rounds, args.rounds // 2)
            ms = time_alone(lambda m=model: m.generate(ids, **kwargs), timer, rounds, args.warmup)
            graphs, breaks = dynamo_graphs()
            problems.append(graph_problem(f"decode {name} batch {B}", graphs, breaks, args.compile))
            results[name] = (ms, graphs, breaks)
            print(f"decode {name} batch {B}: {ms:.1f} ms per generate, {graphs} graphs / {breaks} breaks", flush=True)
            del model
        for name, (ms, graphs, breaks) in results.items():
            vs = f"{results['dense backbone'][0] / ms:.2f}x" if "dense backbone" in results else "n/a"
            lines.append(f"| {B} | {name} | {B * new_tokens / (ms / 1e3):,.0f} | {vs} | {graphs} / {breaks} |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer rounds")
    parser.add_argument("--plan", action="store_true",
                        help="print the cases, their memory estimates and what 80 GB / 141 GB cards skip; run nothing")
    parser.add_argument("--sections", nargs="+", default=["layer", "training", "decode"],
                        choices=["layer", "training", "decode"])
    parser.add_argument("--no_compile", dest="compile", action="store_false")
    parser.add_argument("--out", help="also write the markdown tables to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    q = args.quick or (device.type == "cpu" and not args.plan)
    args.tokens, args.hidden, args.inner = (512, 256, 176) if q else (16384, 2048, 1408)
    args.experts, args.topk = ([8, 32], [1, 2]) if q else ([8, 32, 128], [1, 2, 8])
    args.model_hidden, args.model_inner, args.model_layers = (256, 176, 2) if q else (2048, 1408, 8)
    args.batch, args.seq = (2, 128) if q else (8, 2048)
    args.decode_batches, args.new_tokens = ([1, 4], 8) if q else ([1, 32], 128)
    args.rounds = 3 if q else 10
    # the CPU smoke run measures nothing: each variant runs once after one warm-up (bf16 is emulated on most CPUs)
    smoke = device.type == "cpu" and not args.plan
    args.rounds, args.warmup, args.min_decode_rounds = (1, 1, 1) if smoke else (args.rounds, 2, 3)
    if args.plan:
        lines = plan(args)
        print("\n".join(lines))
        return lines
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (none found). For a smoke run of the code on CPU: --device cpu "
                 "--quick; for the cases and their memory estimates: --plan")
    args.memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    dtype = torch.bfloat16
    timer = Timer(device)
    header = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU smoke run (not a measurement)"
    out = [f"## benchmarks/gpu.py on {header}, torch {torch.__version__}", ""]
    print(out[0], flush=True)
    sections = {"layer": lambda *a: layer_section(*a[:4]), "training": training_section, "decode": decode_section}
    problems = []
    for name in args.sections:
        lines = sections[name](args, device, dtype, timer, problems) + [""]
        print("\n".join(lines), flush=True)
        out += lines
        if args.out:  # written after every section: a later failure keeps the tables already measured
            with open(args.out, "w") as fh:
                fh.write("\n".join(out) + "\n")
    problems = [p for p in problems if p]
    if problems:
        sys.exit("benchmarks/gpu.py: a compiled variant is not one graph:\n  " + "\n  ".join(problems))
    return out


if __name__ == "__main__":
    main()
