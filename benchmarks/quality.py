"""Do the papers' quality claims hold at small scale? MoE against dense at equal active FLOPs, top-2 against top-1,
M6-T expert prototyping against top-k, GShard capacity 1.25 against 2.0, sparse upcycling against continued dense.

    python benchmarks/quality.py            # reduced setting: 2-core CPU, float32 (see SETTINGS["cpu"] for its size)
    python benchmarks/quality.py --full     # full scale: one CUDA GPU, bf16 autocast, 5 seeds
    python benchmarks/quality.py --smoke    # seconds: 2 arms + upcycling, 1 seed, a few steps (the test runs it)

Corpus, models, FLOP count and training loop: `hf_ppmoe/demo/protocol.py` (`hf-ppmoe demo` runs a reduced form
of the same experiment: `dense` against `top2` from scratch, and the upcycling pair). In short: the CPython standard
library's .py files, split into train / held-out by file; byte-level BPE fitted on train; random train windows, the
same for every arm of a seed; AdamW, warmup then cosine decay; held-out loss = LM cross-entropy alone.

Arms, all GPT-MoE (Llama layout: rotary, RMSNorm, SwiGLU) with the same attention, embeddings and head; the FFN of
every other layer is an MoE layer. With F = 4 x hidden the dense FFN's inner size, every MoE arm has the same active
FFN FLOPs per token (k routes x experts of inner size F/k) AND the same expert parameters (8F in total: 8k experts of
F/k), so the MoE arms differ only in how they route:
    dense          dense FFN F everywhere                              (equal active FLOPs, 1/8 the FFN parameters)
    dense_wide     FFN 8F in the MoE layers' places (a one-expert MoE == a dense FFN; no router loss)
                                                                       (equal parameters, 8x the FLOPs there)
    switch         top-1, 8 experts of F (Switch Transformer; dropless)
    top2           top-2 softmax router, 16 experts of F/2 (Mixtral-style, renormalised; dropless)
    top2_m6t       as top2, weights softmax(topk(softmax(Wx))) (M6-T Eq. (1), topk_weighting="m6t")
    gshard_c1.25   GShard Algorithm 1, 16 experts of F/2, capacity factor 1.25 in training (one group per batch)
    gshard_c2.0    the same with capacity factor 2.0
    proto2         M6-T "k top-1" expert prototyping, k = 2 prototypes of 8 experts of F/2
    proto4         k = 4 prototypes of 8 experts of F/4
Upcycling: each seed's final `dense` model is continued for `upcycle_steps` more steps on new batches, either dense
(`upcycle_dense`) or after `hf_ppmoe.conversion.upcycle` to an 8-expert top-2 MoE of full-size experts with a random
router (`upcycle_moe`; Komatsuzaki et al.'s sparse upcycling, which costs more FLOPs per token); the upcycled model's
logits are checked equal to the dense model's before training.

Every finished (arm, seed) run is written to the results JSON at once (benchmarks/results/quality_<setting>.json by
default); a rerun skips the runs found there, so an interrupted run continues where it stopped. The report (markdown
table and a PNG of the curves) is rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_ppmoe import GPTMoEForCausalLM
from hf_ppmoe.demo.protocol import (  # noqa: F401 (the experiment's corpus, models, FLOPs and loop; the test reads them here)
    CPU, SCRATCH_ARMS, Setting, build as build_model, corpus as load_corpus, dense, flops_per_token, moe, parameters, split_files,
    stdlib_files, train, upcycle_from, windows,
)

RESULTS = Path(__file__).parent / "results"

SETTINGS = {
    # ~1M tokens per run (500 steps x 16 x 128), 1.2M-parameter MoEs (0.5M dense); 3 seeds = 33 runs: 0.8 CPU-hours,
    # 1.4 h wall measured with --threads 1 on a shared 2-core machine (5 seeds: 1.2 CPU-hours, 1.9 h)
    "cpu": CPU,
    # ~33M tokens per run (2000 steps x 64 x 256), ~20M-parameter MoEs, 5 seeds; one GPU
    "full": Setting(hidden=256, layers=4, heads=4, block=256, batch=64, vocab=8192, steps=2000, upcycle_steps=1000,
                    evals=20, eval_blocks=1024, lr=1e-3, warmup=100, seeds=5, device="cuda", bf16=True),
    "smoke": Setting(hidden=32, layers=2, heads=2, block=32, batch=4, vocab=320, steps=4, upcycle_steps=2, evals=2,
                     eval_blocks=4, lr=1e-3, warmup=1, seeds=1, max_files=30, arms=("dense", "switch")),
}


def corpus(s: Setting, work: Path) -> dict:
    return load_corpus(work, s.vocab, s.max_files)


# name -> (description, GPT-MoE fields as a function of the dense FFN size F)
ARMS = {
    "dense": ("dense, FFN F", dense),
    "dense_wide": ("dense, FFN 8F in MoE places (= MoE params)", SCRATCH_ARMS["dense_wide"][1]),
    "switch": ("switch top-1, 8 x F", moe("switch", 8, 1)),
    "top2": ("topk top-2, 16 x F/2", moe("topk", 16, 2)),
    "top2_m6t": ("topk top-2 m6t weights, 16 x F/2", moe("topk", 16, 2, topk_weighting="m6t")),
    "gshard_c1.25": ("gshard capacity 1.25, 16 x F/2", moe("gshard", 16, 2, capacity_factor=1.25)),
    "gshard_c2.0": ("gshard capacity 2.0, 16 x F/2", moe("gshard", 16, 2, capacity_factor=2.0)),
    "proto2": ("prototype k=2, 2 x 8 x F/2", moe("prototype", 16, 2)),
    "proto4": ("prototype k=4, 4 x 8 x F/4", moe("prototype", 32, 4)),
    # balancing: as top2, only the balancing differs
    "top2_seq": ("top2, sequence-level aux loss", moe("topk", 16, 2, router_aux_loss_scope="sequence")),
    "top2_global": ("top2, global-batch aux loss (last step's counts)", moe("topk", 16, 2,
                                                                            router_aux_loss_scope="global_batch")),
    "top2_bias": ("top2, bias balancing, no aux loss", moe("topk", 16, 2, router_expert_bias=True,
                                                           router_aux_loss_coef=0.0)),
    "top2_sigmoid": ("top2 sigmoid scores, aux loss", moe("topk", 16, 2, router_score_function="sigmoid")),
    "top2_sigmoid_bias": ("top2 sigmoid, bias balancing, no aux loss (DeepSeek-V3)", moe(
        "topk", 16, 2, router_score_function="sigmoid", router_expert_bias=True, router_aux_loss_coef=0.0)),
}
UPCYCLE_ARMS = {
    "upcycle_dense": "dense checkpoint, continued dense",
    "upcycle_moe": "dense checkpoint upcycled: topk top-2, 8 x F",
}


def build(s: Setting, tokenizer, arm: str, seed: int):
    return build_model(s, tokenizer, ARMS[arm][1], seed)


def run_all(s: Setting, name: str, results_path: Path, work: Path, seeds: list[int], arms: list[str]) -> list[str]:
    """Train every missing (arm, seed) of `arms`, and the upcycling pair when `arms` has the dense arm, saving each
    into `results_path` as it finishes; returns the keys trained by this call."""
    data = corpus(s, work)
    stats = {k: v for k, v in data["stats"].items() if not k.endswith("_files")}
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if results and (results["setting"] != s.compatible() or results["corpus"] != stats):
        old = {**results["setting"], **results["corpus"]}
        differ = sorted(k for k, v in {**s.compatible(), **stats}.items() if old.get(k) != v)
        raise SystemExit(f"{results_path} holds runs of another setting or corpus (differs in {', '.join(differ)}); "
                         "pass --results with a new file, or delete it to start over.")
    environment = {"python": platform.python_version(), "torch": torch.__version__, "device": device_name(s),
                   "threads": torch.get_num_threads()}  # of the first call: the one that made the runs, mostly
    results = {"setting": s.compatible(), "corpus": stats, "environment": results.get("environment", environment),
               "runs": results.get("runs", {})}
    trained = []

    def save(key: str, record: dict) -> None:
        results["runs"][key] = record
        trained.append(key)
        tmp = results_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(results_path)  # an interruption never leaves a half-written results file
        write_report(results, name, results_path)
        r = record
        print(f"{key:>20}: val loss {r['val_loss']:.4f}, {r['train_tokens'] / 1e6:.2f}M tokens, "
              f"{r['tokens_per_s'] or 0:.0f} tokens/s, {r['wall_s']:.0f} s ({r['cpu_s']:.0f} CPU-s)", flush=True)

    def fit(key: str, model, steps: int, data_seed: int, **extra) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        record = train(model, data, s, steps, data_seed, label=key)
        save(key, {**record, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, **extra})

    check = windows(data["val"], torch.arange(2) * s.block, s.block)
    for seed in seeds:
        for arm in arms:
            if f"{arm}/{seed}" in results["runs"]:
                continue
            model = build(s, data["tokenizer"], arm, seed)
            fit(f"{arm}/{seed}", model, s.steps, seed)
            if arm == "dense":
                model.save_pretrained(work / f"{name}-dense-{seed}")
        # the upcycling pair continues this seed's dense arm: it runs with the dense arm (not beside other arms only)
        if "dense" in arms and not all(f"{arm}/{seed}" in results["runs"] for arm in UPCYCLE_ARMS):
            checkpoint = work / f"{name}-dense-{seed}"
            if not checkpoint.exists():  # results cached but the checkpoint gone (another machine): train it again
                model = build(s, data["tokenizer"], "dense", seed)
                fit(f"dense/{seed}", model, s.steps, seed)
                model.save_pretrained(checkpoint)
            dense = GPTMoEForCausalLM.from_pretrained(checkpoint)
            moe_model, gap = upcycle_from(dense, seed, check)
            if gap > 1e-4:
                raise RuntimeError(f"the upcycled model's logits differ from the dense model's by {gap:.2e}")
            for arm, model in (("upcycle_dense", dense), ("upcycle_moe", moe_model)):
                if f"{arm}/{seed}" not in results["runs"]:
                    fit(f"{arm}/{seed}", model, s.upcycle_steps, seed + 1000, logit_gap=gap)
    write_report(results, name, results_path)
    return trained


def device_name(s: Setting) -> str:
    if s.device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


# ------------------------------------------------------------------------------------------------------- report

T95 = [6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812]  # one-sided 95% t, df = 1..10

# (claim, arm, baseline): the claim is that `arm` reaches a LOWER validation loss than `baseline`
CLAIMS = [
    ("MoE (switch top-1) beats dense at equal active FLOPs", "switch", "dense"),
    ("MoE (topk top-2) beats dense at equal active FLOPs", "top2", "dense"),
    ("MoE (gshard, capacity 1.25) beats dense at equal active FLOPs", "gshard_c1.25", "dense"),
    ("MoE (prototype k=2) beats dense at equal active FLOPs", "proto2", "dense"),
    ("top-2 beats top-1 (equal FLOPs and parameters)", "top2", "switch"),
    ("M6-T weighting beats renormalised top-2", "top2_m6t", "top2"),
    ("prototyping k=2 matches or beats top-2", "proto2", "top2"),
    ("prototyping k=4 matches or beats top-2", "proto4", "top2"),
    ("GShard capacity 2.0 beats 1.25", "gshard_c2.0", "gshard_c1.25"),
    ("upcycling beats continued dense training", "upcycle_moe", "upcycle_dense"),
    ("dense with the MoEs' parameters (8x FFN FLOPs there) beats top-2", "dense_wide", "top2"),
    ("batch-level balance loss beats sequence-level (Qwen's global-batch direction)", "top2", "top2_seq"),
    ("global-batch loss from the last step's counts matches or beats the batch's own", "top2_global", "top2"),
    ("bias balancing without aux loss matches or beats the aux loss (softmax)", "top2_bias", "top2"),
    ("sigmoid scores match or beat softmax (aux loss)", "top2_sigmoid", "top2"),
    ("DeepSeek-V3 routing (sigmoid, bias, no aux loss) beats softmax with aux loss", "top2_sigmoid_bias", "top2"),
]


def summary(values: list[float]) -> dict:
    return {"n": len(values), "mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def by_arm(runs: dict) -> dict[str, dict[int, dict]]:
    arms: dict[str, dict[int, dict]] = {}
    for key, record in runs.items():
        arm, seed = key.rsplit("/", 1)
        arms.setdefault(arm, {})[int(seed)] = record
    return arms


def paired(arms: dict, arm: str, baseline: str) -> list[float]:
    """Per-seed differences of the final validation loss, arm - baseline, over the seeds both have."""
    seeds = sorted(set(arms.get(arm, {})) & set(arms.get(baseline, {})))
    return [arms[arm][i]["val_loss"] - arms[baseline][i]["val_loss"] for i in seeds]


def verdict(diffs: list[float]) -> str:
    """Paired one-sided t-test at 5% for 'arm is lower' (and for the reverse)."""
    if len(diffs) < 2:
        return "one seed: no test"
    d = summary(diffs)
    t = d["mean"] / (d["std"] / math.sqrt(d["n"])) if d["std"] > 0 else math.copysign(math.inf, d["mean"])
    critical = T95[min(d["n"] - 1, len(T95)) - 1]
    return "**yes**" if t < -critical else "**reversed**" if t > critical else "null (not resolved)"


def write_report(results: dict, name: str, results_path: Path) -> None:
    """A markdown table (`<results>.md`) and the curves (`<results>.png`) of every finished run."""
    arms = by_arm(results["runs"])
    s, c = results["setting"], results["corpus"]
    wall, cpu = (sum(r[k] for r in results["runs"].values()) for k in ("wall_s", "cpu_s"))
    lines = [
        f"# benchmarks/quality.py, setting `{name}`", "",
        f"Corpus: CPython {c['python']} standard library, {c['files']} .py files ({len(results['runs'])} runs done); "
        f"train {c['train_tokens']:,} tokens ({c['train_bytes'] / 1e6:.1f} MB), validation {c['val_tokens']:,} tokens "
        f"({c['val_bytes'] / 1e6:.1f} MB), byte-level BPE vocabulary {c['vocab_size']} fitted on train.",
        f"Model: hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads, MoE on every other layer; "
        f"{s['steps']} steps of {s['batch']} x {s['block']} tokens ({s['steps'] * s['batch'] * s['block'] / 1e6:.2f}M "
        f"tokens, {s['steps'] * s['batch'] * s['block'] / c['train_tokens']:.2f} epochs); validation on "
        f"{s['eval_blocks'] * s['block']:,} tokens; {results['environment']['device']}, "
        f"{'bf16 autocast' if s['bf16'] else 'float32'}. Loss: validation LM cross-entropy at the end "
        "(mean, sample std, min-max over seeds); delta: paired per seed against the baseline. "
        f"{results['environment']['threads']} thread(s); the runs took {wall / 3600:.2f} h wall, {cpu / 3600:.2f} "
        "CPU-hours.", "",
        "| arm | what | params total / active | train MFLOPs / token | seeds | val loss mean | std | min - max "
        "| delta vs dense (mean +- std) | tokens/s | tokens / CPU-s | dropped routes | max/mean load, end (mean over run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, what in [*((a, d) for a, (d, _) in ARMS.items()), *UPCYCLE_ARMS.items()]:
        if arm not in arms:
            continue
        seeds = arms[arm]
        loss = summary([r["val_loss"] for r in seeds.values()])
        first = next(iter(seeds.values()))
        baseline = "upcycle_dense" if arm.startswith("upcycle") else "dense"
        d = paired(arms, arm, baseline)
        delta = f"{statistics.mean(d):+.4f} +- {statistics.stdev(d) if len(d) > 1 else 0:.4f}" if d and arm != baseline else "-"
        speed = [statistics.median(r[k] for r in seeds.values() if r[k]) for k in ("tokens_per_s", "tokens_per_cpu_s")]
        dropped = [r["curve"][-1]["dropped"] for r in seeds.values() if "dropped" in r["curve"][-1]]
        load = [(r["curve"][-1]["load_max_over_mean"], statistics.mean(p["load_max_over_mean"] for p in r["curve"][1:]))
                for r in seeds.values() if "load_max_over_mean" in r["curve"][-1]]
        lines.append(
            f"| {arm} | {what} | {first['params']['total'] / 1e6:.2f}M / {first['params']['active'] / 1e6:.2f}M "
            f"| {first['flops_per_token']['train'] / 1e6:.2f} | {loss['n']} | {loss['mean']:.4f} | {loss['std']:.4f} "
            f"| {loss['min']:.4f} - {loss['max']:.4f} | {delta} | {speed[0]:,.0f} | {speed[1]:,.0f} "
            f"| {f'{statistics.mean(dropped):.3f}' if dropped else '-'} "
            f"| {f'{statistics.mean(a for a, _ in load):.2f} ({statistics.mean(b for _, b in load):.2f})' if load else '-'} |"
        )
    lines += ["", "Claims (paired one-sided t-test at 5% over seeds; 'null': the spread does not resolve the sign):", "",
              "| claim | arm - baseline, per seed | mean +- std | verdict |", "|---|---|---|---|"]
    for claim, arm, baseline in CLAIMS:
        d = paired(arms, arm, baseline)
        if d:
            lines.append(f"| {claim} | {', '.join(f'{x:+.4f}' for x in d)} | {statistics.mean(d):+.4f} +- "
                         f"{statistics.stdev(d) if len(d) > 1 else 0:.4f} | {verdict(d)} |")
    results_path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(arms, results_path.with_suffix(".png"), name)


def plot(arms: dict, path: Path, name: str) -> None:
    """Validation loss against tokens and against training FLOPs (mean over seeds, min-max band), the paired
    difference to dense against tokens, and the upcycling continuation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def band(ax, records, x="tokens", minus=None, **style):
        xs = [p[x] for p in records[0]["curve"]]
        ys = [[p["val_loss"] - (m["curve"][i]["val_loss"] if m else 0) for i, p in enumerate(r["curve"])]
              for r, m in zip(records, minus or [None] * len(records))]
        mean = [statistics.mean(col) for col in zip(*ys)]
        ax.plot(xs, mean, **style)
        if len(ys) > 1:
            ax.fill_between(xs, [min(col) for col in zip(*ys)], [max(col) for col in zip(*ys)], alpha=0.15,
                            color=ax.lines[-1].get_color())
        return mean

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    routing = [a for a in ARMS if a in arms]
    tail = []
    for arm in routing:
        records = list(arms[arm].values())
        mean = band(axes[0, 0], records, label=arm)
        band(axes[0, 1], records, x="flops", label=arm)
        tail += mean[len(mean) // 4:]
        if arm != "dense" and "dense" in arms:
            seeds = sorted(set(arms[arm]) & set(arms["dense"]))
            band(axes[1, 0], [arms[arm][i] for i in seeds], minus=[arms["dense"][i] for i in seeds], label=arm)
    for ax in axes[0]:
        if tail:
            ax.set_ylim(min(tail) - 0.05, max(tail) + 0.05)
    for arm in UPCYCLE_ARMS:
        if arm in arms:
            band(axes[1, 1], list(arms[arm].values()), label=arm)
    titles = [("validation loss vs training tokens", "tokens", "validation loss"),
              ("validation loss vs training FLOPs (analytic)", "FLOPs", "validation loss"),
              ("paired difference to dense (same seed), < 0: better", "tokens", "val loss - dense val loss"),
              ("upcycling: continuation of the dense checkpoint", "continuation tokens", "validation loss")]
    for ax, (title, xlabel, ylabel) in zip(axes.flat, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    axes[1, 0].axhline(0, color="black", lw=0.8)
    fig.suptitle(f"benchmarks/quality.py, setting {name}: mean over seeds, band = min-max")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--full", action="store_const", dest="setting", const="full", help="GPU, bf16, full scale")
    group.add_argument("--smoke", action="store_const", dest="setting", const="smoke", help="seconds, for the test")
    parser.add_argument("--seeds", type=int, help="seeds 0..N-1 (default: the setting's)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="a subset of the arms (default: the setting's)")
    parser.add_argument("--results", type=Path, help="results JSON (default benchmarks/results/quality_<setting>.json)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/hf-ppmoe-quality"), help="corpus cache, checkpoints")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    parser.add_argument("--report", action="store_true", help="only rewrite the report from the results JSON")
    args = parser.parse_args(argv)
    name = args.setting or "cpu"
    s = SETTINGS[name]
    if s.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--full runs on a CUDA GPU and none is available here; the default setting runs on the CPU.")
    torch.set_num_threads(args.threads)
    results_path = args.results or RESULTS / f"quality_{name}.json"
    if args.report:
        write_report(json.loads(results_path.read_text()), name, results_path)
        return []
    results_path.parent.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.seeds or s.seeds))
    return run_all(s, name, results_path, args.work, seeds, args.arms or list(s.arms or ARMS))


if __name__ == "__main__":
    main(sys.argv[1:])
