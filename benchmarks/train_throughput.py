"""Training throughput of a small GPT-MoE against its dense backbone.

    python benchmarks/train_throughput.py [--rounds 7 --threads 2]

GPT-MoE: 8 experts, MoE every other layer. Dense backbone: the same model with every FFN dense, of the same active
size (inner size k * f for top-k routing, so FLOPs per token are equal). One training step = forward, backward,
AdamW update. The models run interleaved, round after round; the reported number is the median over rounds of
(MoE tokens/s) / (dense tokens/s).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM


def build(args, moe: bool, top_k: int, router_type: str):
    config = GPTMoEConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.inner if moe else top_k * args.inner,
        moe_intermediate_size=args.inner, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        max_position_embeddings=args.seq, num_experts=8, num_experts_per_tok=top_k, router_type=router_type,
        moe_layer_frequency=2, moe_layers=None if moe else [],
    )
    model = GPTMoEForCausalLM(config).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step_time(model, optimizer, batch) -> float:
    start = time.perf_counter()
    model(batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inner", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq))
    tokens = batch.numel()
    print(f"hidden={args.hidden} f={args.inner} layers={args.layers} (MoE every other) vocab={args.vocab} "
          f"batch={args.batch}x{args.seq} threads={args.threads} rounds={args.rounds}")
    print("| gate | k | dense tokens/s | MoE tokens/s | MoE / dense |")
    print("|---|---|---|---|---|")
    for router_type, k in (("switch", 1), ("topk", 2), ("gshard", 2)):
        moe, dense = build(args, True, k, router_type), build(args, False, k, router_type)
        for model, opt in (moe, dense):  # warm-up
            step_time(model, opt, batch)
        times = {"moe": [], "dense": []}
        for _ in range(args.rounds):
            times["moe"].append(step_time(*moe, batch))
            times["dense"].append(step_time(*dense, batch))
        ratio = statistics.median(d / m for m, d in zip(times["moe"], times["dense"]))
        print(f"| {router_type} | {k} | {tokens / statistics.median(times['dense']):,.0f} | "
              f"{tokens / statistics.median(times['moe']):,.0f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
