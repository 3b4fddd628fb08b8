"""Small-scale reproduction of the papers' quality findings, on the built-in corpus (run by hand, minutes on CPU).

    python benchmarks/quality.py [--steps 300 --out /tmp/hf-ppmoe-quality]

1. Routing at equal steps and equal active FLOPs. Every model has the same attention and the same FFN compute per
   token: dense FFN of inner size F; top-1 (Switch) experts of inner size F; top-2 (topk), GShard top-2 with
   capacity, and M6-T "2 top-1" prototypes with experts of inner size F/2. 8 experts, MoE every other layer
   (GShard/PPMoE), same data order, same seed. Reports eval loss and time per step.
2. Upcycling: a dense GPT-2 of the same size pre-trained for --steps, then continued for --steps either dense or upcycled to an
   8-expert top-2 MoE (sparse upcycling), same batches. Reports eval loss of both.
Every run is `hf_ppmoe.training.main`; the numbers are written to stdout as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import GPT2Config

from hf_ppmoe import GPTMoEConfig
from hf_ppmoe.training import TrainArguments, main
from hf_ppmoe.training.data import builtin_corpus, train_tokenizer
from hf_ppmoe.training.tracking import read_jsonl


def run(out: Path, args, seed: int | None = None, **kwargs) -> dict:
    summary = main(
        TrainArguments(
            output_dir=str(out), tokenizer_name=str(args.out / "tokenizer"), max_steps=args.steps,
            per_device_train_batch_size=args.batch_size, block_size=args.block_size, learning_rate=args.lr,
            warmup_steps=args.steps // 10, eval_steps=args.steps, eval_batches=0, logging_steps=1, plots=False,
            seed=args.seed if seed is None else seed, **kwargs,
        )
    )
    speeds = [r["train/tokens_per_second"] for r in read_jsonl(out / "logs" / "metrics.jsonl") if "train/tokens_per_second" in r]
    summary["ms_per_step"] = 1000 * args.batch_size * args.block_size / statistics.median(speeds[1:] or speeds)
    return summary


def main_cli():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/hf-ppmoe-quality"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(builtin_corpus())
    tokenizer.save_pretrained(args.out / "tokenizer")
    F = 4 * args.hidden

    def config(name: str, **moe) -> str:
        path = args.out / f"{name}.json"
        GPTMoEConfig(
            vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=F, num_hidden_layers=args.layers,
            num_attention_heads=args.hidden // 32, max_position_embeddings=args.block_size, num_experts=8,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **moe,
        ).to_json_file(path)
        return str(path)

    variants = {
        "dense (FFN inner F)": config("dense", moe_layers=[]),
        "top-1 Switch (experts F)": config("switch", router_type="switch", num_experts_per_tok=1),
        "top-2 (experts F/2)": config("top2", router_type="topk", num_experts_per_tok=2, moe_intermediate_size=F // 2),
        "GShard top-2, capacity 1.25 (experts F/2)": config(
            "gshard", router_type="gshard", num_experts_per_tok=2, capacity_factor=1.25, moe_intermediate_size=F // 2
        ),
        "M6-T 2 top-1 prototypes (experts F/2)": config(
            "prototype", router_type="prototype", num_experts_per_tok=2, moe_intermediate_size=F // 2
        ),
    }
    results = {name: run(args.out / Path(path).stem, args, config_name=path) for name, path in variants.items()}
    print(f"\n{args.steps} steps, batch {args.batch_size} x {args.block_size} tokens, hidden {args.hidden}, "
          f"{args.layers} layers, 8 experts on every other layer, equal active FFN FLOPs per token, {args.threads} threads")
    print("| model | eval loss | ms / step |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['eval/loss']:.4f} | {r['ms_per_step']:.0f} |")

    GPT2Config(
        vocab_size=len(tokenizer), n_embd=args.hidden, n_layer=args.layers, n_head=args.hidden // 32,
        n_positions=args.block_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ).to_json_file(args.out / "gpt2.json")
    dense = run(args.out / "pretrain", args, config_name=str(args.out / "gpt2.json"))
    continued = run(args.out / "continued", args, model_name_or_path=str(args.out / "pretrain"), seed=args.seed + 1)
    upcycled = run(args.out / "upcycled", args, upcycle_from=str(args.out / "pretrain"), seed=args.seed + 1,
                   num_experts=8, num_experts_per_tok=2, router_type="topk", router_init="random")
    print(f"\nupcycling: dense pre-training {args.steps} steps (eval loss {dense['eval/loss']:.4f}), then {args.steps} more steps")
    print("| continuation | eval loss | ms / step |\n|---|---|---|")
    print(f"| dense, continued | {continued['eval/loss']:.4f} | {continued['ms_per_step']:.0f} |")
    print(f"| upcycled to 8 experts, top-2 (experts F) | {upcycled['eval/loss']:.4f} | {upcycled['ms_per_step']:.0f} |")
    (args.out / "results.json").write_text(json.dumps({"routing": results, "upcycling": {
        "pretrain": dense, "continued": continued, "upcycled": upcycled}}, indent=2, default=str))


if __name__ == "__main__":
    main_cli()
