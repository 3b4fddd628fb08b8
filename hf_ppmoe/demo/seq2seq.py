"""`hf-ppmoe demo --seq2seq`: GShard's comparison on the built-in seq2seq task (no download).

1. the task: functions of the CPython standard library -> the first sentence of their docstring (`stdlib_task.py`),
   split by file, the held-out files named; a byte-level BPE tokenizer fitted on the training pairs;
2. three Seq2Seq models trained from scratch with `hf_ppmoe.training.main` on the same batches, for several seeds:
   an MoE (every FFN `num_experts` experts, top-k), a dense model whose FFN is k experts wide (the MoE's active
   parameters: equal FLOPs per token, the papers' comparison and the headline) and a dense model whose FFN is one
   expert wide (the MoE's width);
3. held-out loss, and chrF / BLEU of GShard flat-beam-search outputs, per seed; a difference is claimed only when
   every seed agrees and the mean exceeds twice the seeds' spread; tokens/s; a plot and generated samples;
4. a report (markdown + PNG).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path

from ..modeling import Seq2SeqMoEConfig, Seq2SeqMoEForConditionalGeneration
from ..training.arguments import TrainArguments
from ..training.data import train_tokenizer
from ..training.stdlib_task import EVALUATION_FILES, stdlib_pairs
from ..training.tracking import curve, read_jsonl
from ..training.train import main as train
from .plots import mean_curve, moving_average, pyplot, save
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


def _verdict(name: str, diffs: list[float], unit: str, higher_is_better: bool) -> str:
    listed = ", ".join(f"{d:+.3f}" for d in diffs)
    if len(diffs) < 2:
        return f"MoE minus {name}: {listed} {unit} from one seed: no spread to compare with, so no difference is claimed."
    mean, spread = statistics.mean(diffs), statistics.stdev(diffs)
    stats = f"MoE minus {name}: {listed} {unit} (mean {mean:+.3f}, standard deviation {spread:.3f} over {len(diffs)} seeds)"
    if abs(mean) <= 2 * spread or not (all(d < 0 for d in diffs) or all(d > 0 for d in diffs)):
        return f"{stats}: within the spread of the seeds, so no difference is claimed."
    better = (mean > 0) == higher_is_better
    return f"{stats}: the {'MoE' if better else name + ' model'} is better in every seed."


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


def run_seq2seq_demo(args) -> Path:
    """The seq2seq demo with `DemoArguments` (steps: --finetune_steps; sizes: --hidden_size, --num_layers,
    --num_experts, --num_experts_per_tok; --seeds, --batch_size, --num_beams, --evaluations)."""
    if args.quick:
        args = dataclasses.replace(args, **QUICK)
    root = Path(args.output_dir)
    (root / "data").mkdir(parents=True, exist_ok=True)
    clock = Clock()
    print("[1/4] reading the standard library's functions and docstrings")
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
    results = {name: [] for name in MODELS}
    for seed in seeds:  # interleaved, so that a change in the machine's load hits every model alike
        for name in MODELS:
            results[name].append(train_run(
                args, root, f"{name}-seed{seed}", steps, seed, 1, config_name=str(root / f"{name}.json"),
                max_source_length=args.block_size, max_target_length=32, generation_num_beams=args.num_beams,
                generation_eval_pairs=pairs,
            ))
            r = results[name][-1]
            print(f"      seed {seed} {name}: held-out loss {r['eval/loss']:.4f}, chrF {r['eval/chrf']:.2f}, BLEU {r['eval/bleu']:.2f}")
    logs = {name: [records(root, f"{name}-seed{s}") for s in seeds] for name in MODELS}
    speed = {name: median_tokens_per_second(runs) for name, runs in logs.items()}
    print("[3/4] plot and samples")
    _plot(logs, root / "training.png")
    samples = read_jsonl(root / f"moe-seed{seeds[0]}" / "logs" / "samples.jsonl")[:3]
    print("[4/4] writing the report")
    verdicts = [_verdict(NAMES[other], [m[key] - o[key] for m, o in zip(results["moe"], results[other])], unit, higher)
                for other in ("dense-active", "dense")
                for key, unit, higher in (("eval/loss", "nats", False), ("eval/chrf", "chrF", True))]

    def spread(name, key):
        values = [r[key] for r in results[name]]
        return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0:.3f}"

    rows = "\n".join(
        f"| {NAMES[name]} | {counts[name][0] / 1e6:.3f}M | {counts[name][1] / 1e6:.3f}M | {spread(name, 'eval/loss')} | "
        f"{spread(name, 'eval/chrf')} | {spread(name, 'eval/bleu')} | {speed[name]:,.0f} |" for name in MODELS)
    per_seed = "\n".join(f"| {seed} | " + " | ".join(f"{results[n][i]['eval/loss']:.4f} / {results[n][i]['eval/chrf']:.2f}"
                                                     for n in MODELS) + " |" for i, seed in enumerate(seeds))
    shown = "\n".join(f"- `{s['source'].splitlines()[0][:90]}` ...\n  - target: {s['target']}\n  - generated: {s['generated']!r}"
                      for s in samples)
    minutes = clock.minutes()
    quick = "\n*`--quick`: tiny models, few steps and few training files: a check that every stage runs, not a result.*\n"
    report = f"""# hf-ppmoe demo --seq2seq
{quick if args.quick else ""}
## Task and data

Python functions of the CPython {'.'.join(map(str, __import__('sys').version_info[:3]))} standard library (no download)
-> the first sentence of their docstring. Split by file: **held-out files** {", ".join(f"`{f}`" for f in EVALUATION_FILES)}
({len(held_pairs)} pairs); training: every other file of the library but tests, GUI toolkits and demos
({len(train_pairs)} pairs). Sources are cut at {args.block_size} tokens, targets at 32 (byte-level BPE,
{len(tokenizer)} tokens, fitted on the training pairs).

## Models, at equal steps on the same batches

Each trained from scratch for {steps} steps of {args.batch_size} pairs, {args.seeds} data-order seeds ({seeds}),
hidden size {args.hidden_size}, {args.num_layers} encoder and {args.num_layers} decoder layers. MoE: every FFN
{args.num_experts} experts of width {2 * args.hidden_size}, top-{args.num_experts_per_tok} (dropless). Held-out loss: cross-entropy per target
token; chrF and BLEU (sacrebleu) of GShard flat beam search outputs ({args.num_beams} beams) for the first {pairs}
held-out pairs. Mean ± standard deviation over the seeds; tokens/s: median step, CPU proxy ({os.cpu_count()} cores,
shared; 1-min load average {clock.load[0]:.1f} at the start).

| model | parameters | active per token | held-out loss | chrF | BLEU | tokens/s |
|---|---|---|---|---|---|---|
{rows}

Per seed, held-out loss / chrF:

| seed | {" | ".join(NAMES[n] for n in MODELS)} |
|---|---|---|---|
{per_seed}

**Equal FLOPs per token (the papers' comparison):** {verdicts[0]} {verdicts[1]}

**Same width:** {verdicts[2]} {verdicts[3]}

![training](training.png)

## Samples (seed {seeds[0]} MoE, flat beam search, held-out)

{shown}

## Run time

{minutes:.1f} minutes on {os.cpu_count()} cores (1-min load average {clock.load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at
the end). Folders: `data/`, `tokenizer/`, `<model>-seed<N>/` (model, card, `logs/metrics.jsonl`, `logs/samples.jsonl`).
"""
    (root / "report.md").write_text(report)
    print(f"done in {minutes:.1f} min: report at {(root / 'report.md').resolve()}")
    return root / "report.md"
