"""Which router initialisation an upcycled model should start from, per built-in gate: exact logits, and experts that
all get tokens while it trains (issue 46).

    python benchmarks/router_init.py [--seeds 0 1 2] [--steps 30] [--out benchmarks/results/router_init_cpu.json]

Protocol (fixed before any result). A random 4-layer Llama (hidden 64, FFN 128, 4 heads, 2 KV heads; vocabulary: a
512-token BPE tokenizer trained on the built-in corpus) is upcycled to 4 experts per MoE layer with the default
layer choice (every second FFN: 2 MoE layers), for each gate (`topk`, `topk` with norm_topk_prob=False, `gshard`,
`switch`, `prototype` with 2 prototypes) and each `router_init` (`zeros`, `random`), and trained 30 steps with AdamW
(lr 3e-3, constant) on batches of 8 random 64-token blocks of the built-in corpus, with the default router losses.
Measured on 16 fixed held-out blocks (1,024 tokens) in evaluation mode: the largest |logit| difference from the dense
model right after upcycling; per MoE layer the experts that receive no route ("dead") at step 0 and at the last
step; the experts that are distinct (whose weights differ from every other expert's of the layer: identical copies
that the router never tells apart stay identical, one expert's worth of capacity) at the last step; the LM loss at
step 0 and at the last step. Seeds 0, 1, 2 (each draws the dense model, the router and the
batches). Decision rule: a gate's default is the init whose step-0 logits equal the dense model's (max difference
below 1e-4) in every seed; where both are exact, the one with more distinct and then fewer dead experts at the last
step, summed over the seeds (a tie: `random`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_ppmoe.conversion import upcycle
from hf_ppmoe.training.data import builtin_corpus, pack, train_tokenizer
from hf_ppmoe.training.tracking import RouterMonitor

GATES = {
    "topk": dict(router_type="topk"),
    "topk (no norm)": dict(router_type="topk", norm_topk_prob=False),
    "gshard": dict(router_type="gshard"),
    "switch": dict(router_type="switch"),
    "prototype": dict(router_type="prototype", num_experts_per_tok=2),
}
INITS = ("zeros", "random")


def dead_experts(model, ids) -> list[int]:
    """Per MoE layer, the experts that no token of `ids` is routed to (evaluation mode)."""
    monitor = RouterMonitor(model)
    model.eval()
    with torch.no_grad():
        model(ids, labels=ids)  # labels: the routing statistics are computed with the losses
    stats = monitor.collect()
    monitor.remove()
    model.train()
    return [v for k, v in sorted(stats.items()) if k.startswith("dead_experts/")]


def distinct_experts(model) -> list[int]:
    """Per MoE layer, the experts whose weights equal no other expert's of the layer (an identical group counts once)."""
    counts = []
    for name, module in sorted(model.named_modules()):
        if name.endswith("mlp.experts"):
            weights = [torch.cat([p[e].flatten() for p in module.parameters()]) for e in range(module.num_experts)]
            counts.append(len({tuple(w.tolist()) for w in weights}))
    return counts


def lm_loss(model, ids) -> float:
    model.eval()
    with torch.no_grad():
        loss = float(model(ids, labels=ids).lm_loss)
    model.train()
    return loss


def run(seed: int, gate: str, init: str, tokenizer, blocks, held_out, steps: int) -> dict:
    torch.manual_seed(seed)
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)).eval()
    with torch.no_grad():
        dense_logits = dense(held_out).logits
    moe = upcycle(dense, num_experts=4, router_init=init, seed=seed, **GATES[gate])
    moe.eval()
    with torch.no_grad():
        difference = float((moe(held_out).logits - dense_logits).abs().max())
    result = dict(seed=seed, gate=gate, router_init=init, max_logit_difference=difference,
                  dead_step0=dead_experts(moe, held_out), lm_loss_step0=lm_loss(moe, held_out))
    optimizer = torch.optim.AdamW(moe.parameters(), lr=3e-3)
    batches = torch.Generator().manual_seed(seed)
    moe.train()
    for _ in range(steps):
        ids = blocks[torch.randint(len(blocks), (8,), generator=batches)]
        moe(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    result.update(dead_last=dead_experts(moe, held_out), distinct_last=distinct_experts(moe), lm_loss_last=lm_loss(moe, held_out))
    return result


def decide(results: list[dict]) -> dict[str, str]:
    """The protocol's decision rule, per gate."""
    choice = {}
    for gate in GATES:
        rows = {init: [r for r in results if r["gate"] == gate and r["router_init"] == init] for init in INITS}
        exact = [init for init in INITS if all(r["max_logit_difference"] < 1e-4 for r in rows[init])]
        if len(exact) == 1:
            choice[gate] = exact[0]
        else:
            score = {init: (sum(sum(r["distinct_last"]) for r in rows[init]), -sum(sum(r["dead_last"]) for r in rows[init]))
                     for init in INITS}
            choice[gate] = "zeros" if score["zeros"] > score["random"] else "random"
    return choice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/router_init_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = train_tokenizer(builtin_corpus()[:40], vocab_size=512)
    blocks = pack(builtin_corpus(), tokenizer, 64)
    blocks, held_out = blocks[:-16], blocks[-16:]
    results, start = [], time.time()
    for seed in args.seeds:
        for gate in GATES:
            for init in INITS:
                results.append(run(seed, gate, init, tokenizer, blocks, held_out, args.steps))
                r = results[-1]
                print(f"seed {seed} {gate:15} {init:6} max|dlogit| {r['max_logit_difference']:.1e}  dead step 0 "
                      f"{r['dead_step0']} -> step {args.steps} {r['dead_last']}  distinct {r['distinct_last']}  LM loss {r['lm_loss_step0']:.3f} -> "
                      f"{r['lm_loss_last']:.3f}", flush=True)
    choice = decide(results)
    print("default per gate:", choice)
    record = dict(protocol=__doc__, steps=args.steps, seeds=args.seeds, seconds=round(time.time() - start),
                  versions=dict(torch=torch.__version__, transformers=__import__("transformers").__version__),
                  results=results, default=choice)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
