"""Decoding throughput: Transformers' continuous batching (`model.generate_batch`, paged attention cache, requests
packed into one ragged batch) against `generate` on the same requests (one left-padded batch), for GPT-MoE and for
Transformers' Qwen3-MoE of the same shape, in the same run. On a CPU this is a proxy: it shows that our model takes
the serving path at the cost Transformers' own MoE model does, not what a GPU server reaches.

Workload: 1, 8 and 32 requests, prompts of mixed lengths (8 to 96 tokens, fixed seed), greedy, each request
generating exactly --new-tokens tokens. Reported per setting: generated tokens/s (all requests' new tokens over the
wall time of the call) and time to first token (TTFT: from the call to a request's first generated token; for
`generate` every request of the batch gets it at the first step, for continuous batching the mean over requests,
from `record_timestamps`). The four variants (2 models x 2 modes) run once per round in a rotating order, --rounds
rounds after a warm-up round; medians are reported, and "vs generate" is the median of the per-round ratios of a
model's two modes, so load from other processes cancels out. Every variant's tokens are checked equal to
`generate`'s, request by request.

Shape: 4 layers, hidden 256, 8 heads (4 key/value heads, head_dim 32, per-head q/k norm), an MoE in every layer of
8 experts of inner size 256, top-2 with renormalised weights, vocab 1024; float32.

    python benchmarks/decode.py                       # 1 thread, 3 rounds, 16 new tokens
    python benchmarks/decode.py --json benchmarks/results/decode_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import time

import torch
import transformers
from transformers import ContinuousBatchingConfig, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM

SHAPE = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=256,
             norm_topk_prob=True, max_position_embeddings=512, pad_token_id=0)
REQUESTS = (1, 8, 32)


def build(name: str, device: str):
    torch.manual_seed(0)
    if name == "gpt_moe":
        config = GPTMoEConfig(**SHAPE, qk_norm=True, moe_layer_frequency=1, router_type="topk")
        model = GPTMoEForCausalLM(config)
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE, decoder_sparse_step=1, mlp_only_layers=[]))
    return model.to(device).eval()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed + n)
    return [[rng.randrange(3, SHAPE["vocab_size"]) for _ in range(rng.randint(8, 96))] for _ in range(n)]


def greedy(new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                            eos_token_id=None)


class FirstStep(LogitsProcessor):
    """Records when `generate` has its first token's scores (every request of the batch at once)."""

    def __init__(self):
        self.at = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            self.at = time.perf_counter()
        return scores


def run_generate(model, batch, new_tokens):
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    first = FirstStep()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, generation_config=greedy(new_tokens),
                         logits_processor=LogitsProcessorList([first]))
    _sync(model)
    wall = time.perf_counter() - start
    return out[:, width:].tolist(), wall, first.at - start


def run_batch(model, batch, new_tokens, cache: dict):
    start = time.perf_counter()
    out = model.generate_batch(batch, generation_config=greedy(new_tokens), record_timestamps=True, warmup=False,
                               continuous_batching_config=ContinuousBatchingConfig(**cache))
    _sync(model)
    wall = time.perf_counter() - start
    if len(out) != len(batch):
        raise RuntimeError(f"continuous batching lost requests: {len(out)} of {len(batch)} came back")
    by_id = sorted(out.values(), key=lambda o: int(o.request_id.split("_")[-1]))
    tokens = [list(o.generated_tokens) for o in by_id]
    ttft = statistics.mean(o.timestamps[0] - start for o in by_id)
    return tokens, wall, ttft


def _sync(model):
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def measure(models: dict, n: int, args, cache: dict) -> list[dict]:
    """Every variant (model x mode) once per round, in an order that rotates each round, after one warm-up round:
    load from other processes falls on all variants alike, and each "vs generate" is the median of per-round ratios."""
    batch = prompts(n)
    variants = [(name, mode) for name in models for mode in ("generate", "continuous batching")]
    runs = {v: [] for v in variants}
    for round_ in range(args.rounds + 1):
        for name, mode in variants[round_ % len(variants):] + variants[:round_ % len(variants)]:
            model = models[name]
            result = run_generate(model, batch, args.new_tokens) if mode == "generate" else (
                run_batch(model, batch, args.new_tokens, cache))
            if round_:
                runs[(name, mode)].append(result)
    rows, generated = [], n * args.new_tokens
    for name, mode in variants:
        results, base = runs[(name, mode)], runs[(name, "generate")]
        rows.append(dict(
            model=name, requests=n, mode=mode, prompt_tokens=sum(map(len, batch)),
            tokens_per_s=generated / statistics.median(r[1] for r in results),
            ttft_ms=1000 * statistics.median(r[2] for r in results),
            vs_generate=statistics.median(g[1] / r[1] for g, r in zip(base, results)),
            same_tokens_as_generate=all(r[0] == base[0][0] for r in results),
        ))
    return rows


def machine() -> dict:
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), uptime=load, python=platform.python_version(),
                torch=torch.__version__, transformers=transformers.__version__, cpu_count=os.cpu_count())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--requests", type=int, nargs="+", default=list(REQUESTS))
    p.add_argument("--json", help="also write the rows and the machine's state here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # a CPU gets a small paged cache (Transformers sizes its default for an accelerator); a GPU, Transformers' sizing
    cache = dict(num_blocks=256, max_batch_tokens=512, page_size=32) if args.device == "cpu" else {}
    info = machine() | dict(device=args.device, threads=args.threads, rounds=args.rounds, new_tokens=args.new_tokens,
                            paged_cache=cache or "Transformers' default")
    rows = []
    models = {name: build(name, args.device) for name in ("gpt_moe", "qwen3_moe")}
    for n in args.requests:
        rows += measure(models, n, args, cache)
    print(f"{info['date']}; {info['uptime']}; torch {info['torch']}, transformers {info['transformers']}; "
          f"{args.device}, {args.threads} thread(s), {args.rounds} rounds, {args.new_tokens} new tokens per request")
    print("\n| model | requests | mode | tokens/s | vs generate | TTFT (ms) | same tokens as generate |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['requests']} | {r['mode']} | {r['tokens_per_s']:.1f} | {r['vs_generate']:.2f}x | "
              f"{r['ttft_ms']:.0f} | {'yes' if r['same_tokens_as_generate'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
