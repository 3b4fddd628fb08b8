"""`hf-ppmoe demo --seq2seq`: GShard's comparison on the built-in seq2seq task (no download).

1. the task: functions of the CPython standard library -> the first sentence of their docstring (`stdlib_task.py`),
   split by file, the held-out files named; a byte-level BPE tokenizer fitted on the training pairs;
2. three Seq2Seq models trained from scratch with `hf_ppmoe.training.main` on the same batches, for several seeds:
   an MoE (every FFN `num_experts` experts, top-k), a dense model whose FFN is k experts wide (the MoE's active
   parameters: equal FLOPs per token, the papers' comparison and the headline) and a dense model whose FFN is one
   expert wide (the MoE's width);
3. held-out loss, and chrF / BLEU of GShard flat-beam-search outputs, per seed; a difference is claimed only when
   every seed agrees and the mean exceeds twice the seeds' spread (the GPT demo's rule, `report.py`); tokens/s; a
   plot and generated samples;
4. results.json, and report.md rendered from it (`report.publish`, as the GPT demo's).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

from ..modeling import Seq2SeqMoEConfig, Seq2SeqMoEForConditionalGeneration
from ..training.arguments import TrainArguments
from ..training.data import train_tokenizer
from ..training.stdlib_task import EVALUATION_FILES, stdlib_pairs
from ..training.tracking import curve, read_jsonl
from ..training.train import main as train
from .plots import mean_curve, moving_average, pyplot, save
from .report import CLAIM_RULE, compare, environment, publish, run_time, sentence
from .runs import Clock

QUICK = dict(finetune_steps=4, seeds=2, batch_size=16, block_size=32, hidden_size=32, num_layers=2, num_experts=4,
             num_beams=2, evaluations=2, eval_pairs=4)
MODELS = ("moe", "dense-active", "dense")  # the MoE, dense at its active parameters, dense at its width
NAMES = {"moe": "MoE", "dense-active": "dense, equal active parameters", "dense": "dense, one expert wide"}


def data_order_seeds(args) -> list[int]:
    """The seeds of the compared runs (--seeds of them, from --seed + 1)."""
    return [args.seed + 1 + i for i in range(args.seeds)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def train_run(args, root: Path, out: str, steps: int, seed: int, logging_steps: int, **options) -> dict:
    """Train with `hf_ppmoe.training.main` into root/out on root/data/{train,held-out}.jsonl and root/tokenizer, with
    the demo's batch size, learning rate, warm-up and evaluations (`options`: the model and the task's arguments);
    returns the final metrics."""
    return train(
        TrainArguments(
            output_dir=str(root / out), tokenizer_name=str(root / "tokenizer"), max_steps=steps,
            train_file=[str(root / "data" / "train.jsonl")], validation_file=[str(root / "data" / "held-out.jsonl")],
            per_device_train_batch_size=args.batch_size, learning_rate=args.learning_rate,
            warmup_steps=max(1, steps // 10), eval_steps=max(1, steps // args.evaluations), eval_batches=0, seed=seed,
            logging_steps=logging_steps, plots=False, **options,
        )
    )


def records(root: Path, run: str) -> list[dict]:
    """The metrics the run root/run logged."""
    return read_jsonl(root / run / "logs" / "metrics.jsonl")


def median_tokens_per_second(runs: list[list[dict]]) -> float:
    """Median over every step but each run's first (which includes start-up) of the logged tokens/s."""
    return statistics.median(v for r in runs for v in curve(r, "train/tokens_per_second")[1][1:])


def _config(args, tokenizer, name: str) -> Seq2SeqMoEConfig:
    k, width = args.num_experts_per_tok, 2 * args.hidden_size  # an expert's FFN width
    dense = dict(encoder_moe_layers=[], decoder_moe_layers=[])
    return Seq2SeqMoEConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
        num_attention_heads=max(1, args.hidden_size // 32), relative_attention_num_buckets=16,
        intermediate_size=width * (k if name == "dense-active" else 1), num_experts=args.num_experts,
        num_experts_per_tok=k, router_type="topk", moe_layer_frequency=1, **(dense if name != "moe" else {}),
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
    )


def _plot(logs: dict[str, list[list[dict]]], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for (name, seeds), color in zip(logs.items(), ("tab:red", "tab:blue", "tab:gray")):
        steps = curve(seeds[0], "train/lm_loss")[0]
        axes[0].plot(steps, moving_average(mean_curve([curve(r, "train/lm_loss")[1] for r in seeds]), 10), color=color, label=NAMES[name])
        points = curve(seeds[0], "eval/loss")[0]
        axes[0].plot(points, mean_curve([curve(r, "eval/loss")[1] for r in seeds]), color=color, marker="o", linestyle="--")
        axes[1].plot(steps, moving_average(mean_curve([curve(r, "train/tokens_per_second")[1] for r in seeds]), 10), color=color,
                     label=NAMES[name])
    axes[0].set(title=f"LM loss (train, 10-step mean; held-out, dots; mean of {len(seeds)} seeds)", xlabel="step",
                ylabel="cross-entropy (nats per target token)")
    axes[1].set(title="tokens/s (CPU proxy)", xlabel="step")
    axes[0].legend()
    save(fig, path)


# (name, statement, arm, baseline, metric, better, unit)
CLAIMS = [
    ("equal_flops_loss", "At equal FLOPs per token, the MoE reaches a lower held-out loss than the dense model of its "
     "active parameters", "moe", "dense-active", "eval/loss", "lower", "nats"),
    ("equal_flops_chrf", "Its flat-beam-search outputs reach a higher chrF", "moe", "dense-active", "eval/chrf", "higher",
     "chrF"),
    ("same_width_loss", "The MoE reaches a lower held-out loss than a dense model one expert wide", "moe", "dense",
     "eval/loss", "lower", "nats"),
    ("same_width_chrf", "Its flat-beam-search outputs reach a higher chrF", "moe", "dense", "eval/chrf", "higher", "chrF"),
]


def run_seq2seq_demo(args) -> Path:
    """The seq2seq demo with `DemoArguments` (steps: --finetune_steps; sizes: --hidden_size, --num_layers,
    --num_experts, --num_experts_per_tok; --seeds, --batch_size, --num_beams, --evaluations)."""
    if args.quick:
        args = dataclasses.replace(args, **QUICK)
    root = Path(args.output_dir)
    (root / "data").mkdir(parents=True, exist_ok=True)
    clock = Clock()
    print("[1/4] reading the standard library's functions and docstrings")
    with clock.stage("data"):
        train_pairs, held_pairs = stdlib_pairs(40 if args.quick else None)
        write_jsonl(root / "data" / "train.jsonl", train_pairs)
        write_jsonl(root / "data" / "held-out.jsonl", held_pairs)
        tokenizer = train_tokenizer([t for p in train_pairs for t in (p["source"], p["target"])])
        tokenizer.save_pretrained(root / "tokenizer")
    counts = {}
    for name in MODELS:
        _config(args, tokenizer, name).to_json_file(root / f"{name}.json")
        model = Seq2SeqMoEForConditionalGeneration(_config(args, tokenizer, name))
        counts[name] = (model.num_parameters(), model.num_active_parameters())
    seeds = data_order_seeds(args)
    steps, pairs = args.finetune_steps, min(len(held_pairs), args.eval_pairs)
    print(f"[2/4] training {', '.join(MODELS)} for {steps} steps on the same batches, seeds {seeds}")
    finals = {name: {} for name in MODELS}
    with clock.stage("training"):
        for seed in seeds:  # interleaved, so that a change in the machine's load hits every model alike
            for name in MODELS:
                r = finals[name][str(seed)] = train_run(
                    args, root, f"{name}-seed{seed}", steps, seed, 1, config_name=str(root / f"{name}.json"),
                    max_source_length=args.block_size, max_target_length=32, generation_num_beams=args.num_beams,
                    generation_eval_pairs=pairs,
                )
                print(f"      seed {seed} {name}: held-out loss {r['eval/loss']:.4f}, chrF {r['eval/chrf']:.2f}, "
                      f"BLEU {r['eval/bleu']:.2f}")
    logs = {name: [records(root, f"{name}-seed{s}") for s in seeds] for name in MODELS}
    print("[3/4] plot and samples")
    _plot(logs, root / "training.png")
    print("[4/4] writing results.json and the report")
    metric = lambda name, key: {seed: r[key] for seed, r in finals[name].items()}  # noqa: E731
    results = {
        "quick": args.quick, "python": ".".join(map(str, sys.version_info[:3])), "seeds": seeds, "steps": steps,
        "setting": {k: getattr(args, k) for k in ("batch_size", "block_size", "hidden_size", "num_layers", "num_experts",
                                                   "num_experts_per_tok", "num_beams", "learning_rate")},
        "task": {"held_out_files": list(EVALUATION_FILES), "held_out_pairs": len(held_pairs),
                 "train_pairs": len(train_pairs), "vocab_size": len(tokenizer), "eval_pairs": pairs},
        "models": {name: {"description": NAMES[name], "params_total": counts[name][0], "params_active": counts[name][1],
                          "tokens_per_s": median_tokens_per_second(logs[name]),
                          **{key.removeprefix("eval/"): metric(name, key) for key in ("eval/loss", "eval/chrf", "eval/bleu")}}
                   for name in MODELS},
        "claims": {claim: {"statement": statement, "arm": arm, "baseline": baseline,
                           **compare(metric(arm, key), metric(baseline, key), better, unit)}
                   for claim, statement, arm, baseline, key, better, unit in CLAIMS},
        "samples": read_jsonl(root / f"moe-seed{seeds[0]}" / "logs" / "samples.jsonl")[:3],
        "stages_s": clock.stages, "run_time_min": clock.minutes(), "environment": environment(clock.load[0]),
    }
    path = publish(root, results, report_markdown)
    print(f"done: {run_time(results)}\nReport at {path.resolve()}")
    return path


def report_markdown(r: dict) -> str:
    """report.md from results.json's content `r`."""
    s, task, models, seeds = r["setting"], r["task"], r["models"], r["seeds"]

    def spread(name, key):
        values = list(models[name][key].values())
        return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0:.3f}"

    rows = "\n".join(
        f"| {m['description']} | {m['params_total'] / 1e6:.3f}M | {m['params_active'] / 1e6:.3f}M | {spread(name, 'loss')} | "
        f"{spread(name, 'chrf')} | {spread(name, 'bleu')} | {m['tokens_per_s']:,.0f} |" for name, m in models.items())
    per_seed = "\n".join(f"| {seed} | " + " | ".join(f"{m['loss'][str(seed)]:.4f} / {m['chrf'][str(seed)]:.2f}"
                                                     for m in models.values()) + " |" for seed in seeds)
    shown = "\n".join(f"- `{x['source'].splitlines()[0][:90]}` ...\n  - target: {x['target']}\n  - generated: {x['generated']!r}"
                      for x in r["samples"])
    claims = {name: f"{c['statement']}: {sentence(c)}" for name, c in r["claims"].items()}
    quick = "\n*`--quick`: tiny models, few steps and few training files: a check that every stage runs, not a result.*\n"
    env = r["environment"]
    return f"""# hf-ppmoe demo --seq2seq
{quick if r["quick"] else ""}
## Task and data

Python functions of the CPython {r["python"]} standard library (no download)
-> the first sentence of their docstring. Split by file: **held-out files** {", ".join(f"`{f}`" for f in task["held_out_files"])}
({task["held_out_pairs"]} pairs); training: every other file of the library but tests, GUI toolkits and demos
({task["train_pairs"]} pairs). Sources are cut at {s["block_size"]} tokens, targets at 32 (byte-level BPE,
{task["vocab_size"]} tokens, fitted on the training pairs).

## Models, at equal steps on the same batches

Each trained from scratch for {r["steps"]} steps of {s["batch_size"]} pairs, {len(seeds)} data-order seeds ({seeds}),
hidden size {s["hidden_size"]}, {s["num_layers"]} encoder and {s["num_layers"]} decoder layers. MoE: every FFN
{s["num_experts"]} experts of width {2 * s["hidden_size"]}, top-{s["num_experts_per_tok"]} (dropless). Held-out loss: cross-entropy per target
token; chrF and BLEU (sacrebleu) of GShard flat beam search outputs ({s["num_beams"]} beams) for the first {task["eval_pairs"]}
held-out pairs. Mean ± standard deviation over the seeds; tokens/s: median step, CPU proxy ({env["cores"]} cores,
shared; 1-min load average {env["load_start"]:.1f} at the start).

| model | parameters | active per token | held-out loss | chrF | BLEU | tokens/s |
|---|---|---|---|---|---|---|
{rows}

Per seed, held-out loss / chrF:

| seed | {" | ".join(m["description"] for m in models.values())} |
|---|---|---|---|
{per_seed}

**Equal FLOPs per token (the papers' comparison):** {claims["equal_flops_loss"]} {claims["equal_flops_chrf"]}

**Same width:** {claims["same_width_loss"]} {claims["same_width_chrf"]}

{CLAIM_RULE} Every number is in `results.json` beside this report.

![training](training.png)

## Samples (seed {seeds[0]} MoE, flat beam search, held-out)

{shown}

## Run time

{run_time(r)} Folders: `data/`, `tokenizer/`, `<model>-seed<N>/` (model, card, `logs/metrics.jsonl`,
`logs/samples.jsonl`).
"""
