"""Do the papers' quality claims hold at small scale? MoE against dense at equal active FLOPs, top-2 against top-1,
M6-T expert prototyping against top-k, GShard capacity 1.25 against 2.0, sparse upcycling against continued dense;
and the main job's budget curve.

    python benchmarks/quality.py            # reduced setting: 2-core CPU, float32 (see SETTINGS["cpu"] for its size)
    python benchmarks/quality.py --curve    # the demo's budget curve: its arms at 1, 2, 4 and 8M tokens, seeds 0-4
    python benchmarks/quality.py --full     # full scale: one CUDA GPU, bf16 autocast, 5 seeds
    python benchmarks/quality.py --smoke    # seconds: 2 arms + upcycling, 1 seed, a few steps (the test runs it)

Corpus, models, FLOP count, training loop: `hf_ppmoe/demo/protocol.py` and `loop.py` (`hf-ppmoe demo` runs the
`dense`, `top2_e4` and upcycling arms of the same experiment; the rules that fixed it: benchmarks/PROTOCOL.md). In
short: the CPython standard library's .py files, split into train / held-out by file; byte-level BPE fitted on train;
random train windows, the same for every arm of a seed; AdamW, warmup-stable-decay; held-out loss = LM cross-entropy.

Arms, all GPT-MoE (Llama layout: rotary, RMSNorm, SwiGLU) with the same attention, embeddings and head. With F = 4 x
hidden the dense FFN's inner size, every MoE arm has the dense model's active FFN FLOPs per token (k routes x experts
of inner size F/k). The routing arms put an MoE layer in every other FFN with the same expert parameters (8F in
total: 8k experts of F/k), so they differ only in how they route:
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
    top2_e4        the demo's MoE: top-2 of 4 experts of F/2 in every FFN (2F of experts per layer)
    dense_2f       the demo's parameter bound: every FFN 2F wide
Upcycling (`upcycle_moe`): each seed's `dense` run at half the budget, upcycled by `hf_ppmoe.conversion.upcycle` to
an 8-expert top-2 MoE of full-size experts with a random router and the dense run's optimizer state, trained the
second half beside the dense run (its baseline; Komatsuzaki et al.'s sparse upcycling, which costs more FLOPs per
token); the upcycled model's logits are checked equal to the dense model's before training.

Budgets (`--budgets`, steps): the warmup-stable-decay schedule makes a run of B steps the same run as a longer one
until its cool-down starts, so each (arm, seed) trains once on the longest budget's schedule and every shorter budget
branches from it at its cool-down; each branch is exactly the run `hf-ppmoe demo --tokens` makes at that budget.

Every finished (arm, seed, budget) run is written to the results JSON at once (benchmarks/results/quality_<setting>
.json by default; several processes may share it); a rerun skips the runs found there and goes on from an arm's
last saved fork (under `--work`, per setting; saving and loading a run are exact), so an interrupted run continues
where it stopped. The report (markdown table and a PNG of the curves) is rewritten after every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_ppmoe.demo.loop import Run, cooldown_start, held_out_blocks, train, window_losses
from hf_ppmoe.demo.protocol import (  # noqa: F401 (the experiment's corpus, models and FLOPs; the test reads them here)
    CPU, SCRATCH_ARMS, Setting, build as build_model, check_blocks, corpus as load_corpus, dense, flops_per_token, moe,
    parameters, result, split_files, stdlib_files, upcycle_run,
)
from hf_ppmoe.demo.report import judge

RESULTS = Path(__file__).parent / "results"
CURVE_BUDGETS = [500, 1000, 2000, 4000]  # steps of 2,048 tokens: 1.02M, 2.05M, 4.10M, 8.19M tokens
NOISE_BLOCKS = [160, 640, 2560]  # the held-out set sizes whose evaluation noise R7 of benchmarks/PROTOCOL.md measures

SETTINGS = {
    # the protocol of `hf-ppmoe demo` (hf_ppmoe.demo.protocol.CPU): ~2M tokens per run, 0.5M-parameter dense model
    "cpu": CPU,
    # ~33M tokens per run (2000 steps x 64 x 256), ~20M-parameter MoEs, 5 seeds; one GPU
    "full": Setting(hidden=256, layers=4, heads=4, block=256, batch=64, vocab=8192, steps=2000, lr=1e-3, warmup=100,
                    eval_every=100, eval_blocks=1024, final_blocks=1024, seeds=5, device="cuda", bf16=True),
    "smoke": Setting(hidden=32, layers=2, heads=2, block=32, batch=4, vocab=320, steps=8, lr=1e-3, warmup=1,
                     eval_every=1, eval_blocks=4, final_blocks=6, seeds=1, max_files=30, arms=("dense", "switch")),
}


def corpus(s: Setting, work: Path) -> dict:
    return load_corpus(work, s.vocab, s.max_files)


# name -> (description, GPT-MoE fields as a function of the dense FFN size F)
ARMS = {
    "dense": ("dense, FFN F", dense),
    "dense_wide": ("dense, FFN 8F in MoE places (= MoE params)", lambda F: dict(
        router_type="topk", num_experts=1, num_experts_per_tok=1, moe_intermediate_size=8 * F,
        router_aux_loss_coef=0.0, router_z_loss_coef=0.0)),
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
    # the demo's arms (hf_ppmoe.demo.protocol.SCRATCH_ARMS)
    "top2_e4": ("topk top-2, 4 x F/2, every FFN (the demo's MoE)", SCRATCH_ARMS["moe_scratch"][1]),
    "dense_2f": ("dense, every FFN 2F (the demo's parameter bound)", SCRATCH_ARMS["dense_wide"][1]),
}
UPCYCLE_ARMS = {"upcycle_moe": "dense run at half the budget upcycled: topk top-2, 8 x F, optimizer state copied"}


def build(s: Setting, tokenizer, arm: str, seed: int):
    return build_model(s, tokenizer, ARMS[arm][1], seed)


def key(arm: str, seed: int, steps: int) -> str:
    return f"{arm}/{seed}@{steps}"


class Results:
    """The results JSON, shared by processes: every save re-reads it under a lock and adds one run."""

    def __init__(self, path: Path, s: Setting, stats: dict, environment: dict):
        self.path, self.head = path, {"setting": s.compatible(), "corpus": stats, "environment": environment}
        if path.exists():
            results = json.loads(path.read_text())
            if results["setting"] != s.compatible() or results["corpus"] != stats:
                old = {**results["setting"], **results["corpus"]}
                differ = sorted(k for k, v in {**s.compatible(), **stats}.items() if old.get(k) != v)
                raise SystemExit(f"{path} holds runs of another setting or corpus (differs in {', '.join(differ)}); "
                                 "pass --results with a new file, or delete it to start over.")

    def locked(self):
        """A context manager: the results as they are on disk, written back (atomically) when the block ends."""
        path, head = self.path, self.head

        class Lock:
            def __enter__(self):
                self.file = open(path.with_suffix(".lock"), "w")
                fcntl.flock(self.file, fcntl.LOCK_EX)
                on_disk = json.loads(path.read_text()) if path.exists() else {}
                self.results = {**head, "environment": on_disk.get("environment", head["environment"]),
                                "runs": on_disk.get("runs", {})}
                return self.results

            def __exit__(self, *error):
                if not error[0]:
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(json.dumps(self.results, indent=1))
                    tmp.replace(path)  # an interruption never leaves a half-written results file
                fcntl.flock(self.file, fcntl.LOCK_UN)
                self.file.close()

        return Lock()

    def read(self) -> dict:
        with self.locked() as results:
            return dict(results)

    def runs(self) -> dict:
        return self.read()["runs"]

    def add(self, k: str, record: dict) -> dict:
        with self.locked() as results:
            results["runs"][k] = record
            return dict(results)


def run_all(s: Setting, name: str, results_path: Path, work: Path, seeds: list[int], arms: list[str],
            budgets: list[int], noise: bool = False, upcycling: bool = True, verbose: bool = True) -> list[str]:
    """Train every missing (arm, seed, budget) of `arms` x `seeds` x `budgets`, and the upcycling arm when `arms` has
    the dense arm (and `upcycling`), saving each into `results_path` as it finishes; returns the keys trained by this
    call. `noise`: also record every run's per-window final losses on NOISE_BLOCKS windows (R7)."""
    data = corpus(s, work)
    stats = {k: v for k, v in data["stats"].items() if not k.endswith("_files")}
    environment = {"python": platform.python_version(), "torch": torch.__version__, "device": device_name(s),
                   "threads": torch.get_num_threads()}  # of the first call: the one that made the runs, mostly
    store = Results(results_path, s, stats, environment)
    budgets, trained = sorted(budgets), []
    setting_digest = hashlib.sha1(json.dumps(s.compatible(), sort_keys=True).encode()).hexdigest()[:10]
    check = check_blocks(data, s)

    def finish(k: str, run: Run, started: int, began: tuple, **extra) -> None:
        record = {**result(run, s, started), **extra, "wall_s": time.perf_counter() - began[0],
                  "cpu_s": time.process_time() - began[1]}
        if noise:
            record["windows"] = {str(n): window_losses(run.model, held_out_blocks(data, s, n), s).tolist() for n in NOISE_BLOCKS}
        results = store.add(k, record)
        trained.append(k)
        write_report(results, name, results_path)
        print(f"{k:>24}: val loss {record['val_loss']:.4f}, {record['train_tokens'] / 1e6:.2f}M tokens, "
              f"{record['tokens_per_cpu_s'] or 0:.0f} tokens/CPU-s, {record['wall_s']:.0f} s ({record['cpu_s']:.0f} CPU-s)",
              flush=True)

    for seed in seeds:
        for arm in arms:
            upcycled = upcycling and arm == "dense"
            done = store.runs()
            wanted = [b for b in budgets if key(arm, seed, b) not in done
                      or (upcycled and key("upcycle_moe", seed, b) not in done)]
            if not wanted:
                continue
            states = work / "states" / f"{name}-{arm}-{seed}-{setting_digest}"  # never another setting's saved run
            forks = sorted({cooldown_start(s, b) for b in budgets[:-1]} | ({b // 2 for b in budgets} if upcycled else set()))
            if any(point % s.eval_every for point in forks):
                raise SystemExit(f"--budgets {budgets}: every budget's cool-down start and half must be a multiple of "
                                 f"eval_every ({s.eval_every} steps), where a run can be saved; {forks}")
            last, began = budgets[-1], (time.perf_counter(), time.process_time())
            saved = [point for point in forks if (states / f"step{point}").is_dir()]
            if saved:  # an interrupted arm goes on from its last saved fork (save and load are exact)
                run = Run.load(states / f"step{saved[-1]}", s)
            else:
                run = Run.start(build(s, data["tokenizer"], arm, seed), s, seed)
            for point in forks:  # the longest budget's run, saved where shorter budgets branch off
                if point <= run.step:
                    continue
                train(run, data, s, point, last, label=f"{arm}/{seed}", verbose=verbose)
                run.save(states / f"step{point}")
            for b in budgets:
                if b not in wanted:
                    continue
                if b == last:
                    branch = train(run, data, s, last, last, label=key(arm, seed, last), verbose=verbose)
                else:
                    branch = train(Run.load(states / f"step{cooldown_start(s, b)}", s), data, s, b, b,
                                   label=key(arm, seed, b), verbose=verbose)
                if key(arm, seed, b) not in done:
                    finish(key(arm, seed, b), branch, 0, began)
                if upcycled and key("upcycle_moe", seed, b) not in done:
                    up_began = (time.perf_counter(), time.process_time())
                    moe_run, gap = upcycle_run(Run.load(states / f"step{b // 2}", s), s, seed, check)
                    if gap > 1e-4:
                        raise RuntimeError(f"the upcycled model's logits differ from the dense model's by {gap:.2e}")
                    train(moe_run, data, s, b, b, label=key("upcycle_moe", seed, b), verbose=verbose)
                    finish(key("upcycle_moe", seed, b), moe_run, b // 2, up_began, logit_gap=gap)
    write_report(store.read(), name, results_path)
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
    ("upcycling beats continued dense training", "upcycle_moe", "dense"),
    ("the demo's MoE (top-2 of 4 x F/2, every FFN) beats dense at equal active FLOPs", "top2_e4", "dense"),
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


# the claims of `hf-ppmoe demo` (hf_ppmoe.demo.report.CLAIMS) in this benchmark's arm names
DEMO_CLAIMS = {"from_scratch": ("top2_e4", "dense"), "upcycling": ("upcycle_moe", "dense")}


def by_budget(runs: dict) -> dict[int, dict[str, dict[int, dict]]]:
    """{budget in steps: {arm: {seed: record}}}."""
    out: dict[int, dict[str, dict[int, dict]]] = {}
    for k, record in runs.items():
        name, steps = k.rsplit("@", 1)
        arm, seed = name.rsplit("/", 1)
        out.setdefault(int(steps), {}).setdefault(arm, {})[int(seed)] = record
    return dict(sorted(out.items()))


def paired(arms: dict, arm: str, baseline: str) -> dict[int, float]:
    """Per-seed differences of the final held-out loss, arm - baseline, over the seeds both have."""
    seeds = sorted(set(arms.get(arm, {})) & set(arms.get(baseline, {})))
    return {i: arms[arm][i]["val_loss"] - arms[baseline][i]["val_loss"] for i in seeds}


def dense_tokens_to_match(budgets: dict, seed: int, loss: float) -> float | None:
    """Tokens the seed's dense runs need to reach `loss`: log-linear interpolation of their final losses between
    the budgets (None outside the measured range)."""
    points = sorted((b, arms["dense"][seed]["val_loss"], arms["dense"][seed]["train_tokens"])
                    for b, arms in budgets.items() if seed in arms.get("dense", {}))
    for (_, l0, t0), (_, l1, t1) in zip(points, points[1:]):
        if l1 <= loss <= l0:
            return math.exp(math.log(t0) + (l0 - loss) / (l0 - l1) * (math.log(t1) - math.log(t0)))
    return None


def curve_summary(results: dict) -> dict:
    """The budget curve as `hf_ppmoe.demo.budget.CURVE` holds it: per demo claim and budget, the per-seed
    differences, their mean and standard deviation, the seeds lower ("agree"), the demo's rule's verdict over all the
    seeds, and how many of the sets of as many seeds as a demo runs (3 of the 5) the rule holds for ("subsets": what a
    user's own seeds would show, if they behave like these); and per budget the tokens the dense model needs to reach
    the MoE's loss (per seed)."""
    budgets = by_budget(results["runs"])
    s = results["setting"]
    summary_ = {"setting": s, "seeds": sorted({seed for arms in budgets.values() for seed in arms.get("dense", {})}),
                "claims": {}}
    for claim, (arm, baseline) in DEMO_CLAIMS.items():
        points = []
        for steps, arms in budgets.items():
            diffs = paired(arms, arm, baseline)
            if len(diffs) < 2:
                continue
            values = list(diffs.values())
            subsets = list(itertools.combinations(values, min(CPU.seeds, len(values))))
            point = {"tokens": steps * s["batch"] * s["block"], "per_seed": {str(k): v for k, v in diffs.items()},
                     "mean": statistics.mean(values), "std": statistics.stdev(values),
                     "agree": sum(v < 0 for v in values), "verdict": judge(values),
                     "subsets": {"size": len(subsets[0]), "holds": sum(judge(list(c)) == "holds" for c in subsets),
                                 "of": len(subsets)}}
            if claim == "from_scratch":
                point["dense_tokens_to_match"] = {str(seed): dense_tokens_to_match(budgets, seed, arms[arm][seed]["val_loss"])
                                                  for seed in diffs}
            points.append(point)
        summary_["claims"][claim] = points
    return summary_


def verdict(diffs: list[float]) -> str:
    """Paired one-sided t-test at 5% for 'arm is lower' (and for the reverse)."""
    if len(diffs) < 2:
        return "one seed: no test"
    d = summary(diffs)
    t = d["mean"] / (d["std"] / math.sqrt(d["n"])) if d["std"] > 0 else math.copysign(math.inf, d["mean"])
    critical = T95[min(d["n"] - 1, len(T95)) - 1]
    return "**yes**" if t < -critical else "**reversed**" if t > critical else "null (not resolved)"


def evaluation_noise(budgets: dict, resamples: int = 1000) -> list[dict]:
    """R7 of benchmarks/PROTOCOL.md: for each demo claim, budget and seed whose runs recorded per-window losses
    (`--noise`), the bootstrap standard error (`resamples` draws of the windows, with replacement) of the paired
    difference arm - baseline, for each held-out set size of NOISE_BLOCKS."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for steps, arms in budgets.items():
        for claim, (arm, baseline) in DEMO_CLAIMS.items():
            for seed in sorted(set(arms.get(arm, {})) & set(arms.get(baseline, {}))):
                mine, theirs = arms[arm][seed].get("windows"), arms[baseline][seed].get("windows")
                if not mine or not theirs:
                    continue
                row = {"steps": steps, "claim": claim, "seed": seed}
                for n in NOISE_BLOCKS:
                    diff = torch.tensor(mine[str(n)], dtype=torch.float64) - torch.tensor(theirs[str(n)], dtype=torch.float64)
                    draws = torch.randint(len(diff), (resamples, len(diff)), generator=generator)
                    row[n] = {"difference": diff.mean().item(), "se": diff[draws].mean(1).std().item()}
                rows.append(row)
    return rows


def write_report(results: dict, name: str, results_path: Path) -> None:
    """A markdown table (`<results>.md`) and the curves (`<results>.png`) of every finished run."""
    budgets = by_budget({k: v for k, v in results["runs"].items() if "@" in k})
    s, c = results["setting"], results["corpus"]
    wall, cpu = (sum(r[k] for r in results["runs"].values()) for k in ("wall_s", "cpu_s"))
    lines = [
        f"# benchmarks/quality.py, setting `{name}`", "",
        f"Corpus: CPython {c['python']} standard library, {c['files']} .py files ({len(results['runs'])} runs done); "
        f"train {c['train_tokens']:,} tokens ({c['train_bytes'] / 1e6:.1f} MB), validation {c['val_tokens']:,} tokens "
        f"({c['val_bytes'] / 1e6:.1f} MB), byte-level BPE vocabulary {c['vocab_size']} fitted on train.",
        f"Model: hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads; {s['batch']} x {s['block']} tokens per "
        f"step, peak lr {s['lr']}, warm-up {s['warmup']}, cool-down over the last {s['decay']:.0%}; held-out loss on "
        f"{s['final_blocks'] * s['block']:,} tokens; {results['environment']['device']}, "
        f"{'bf16 autocast' if s['bf16'] else 'float32'}. Loss: held-out LM cross-entropy at the end "
        "(mean, sample std, min-max over seeds); delta: paired per seed against the baseline. "
        f"{results['environment']['threads']} thread(s); the runs took {wall / 3600:.2f} h wall, {cpu / 3600:.2f} "
        "CPU-hours (a branch counts from its arm's start).",
    ]
    for steps, arms in budgets.items():
        lines += ["", f"## {steps} steps ({steps * s['batch'] * s['block'] / 1e6:.2f}M tokens)", "",
                  "| arm | what | params total / active | train MFLOPs / token | seeds | val loss mean | std | min - max "
                  "| delta vs dense (mean +- std) | tokens / CPU-s | dropped routes | max/mean load, end (mean over run) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm, what in [*((a, d) for a, (d, _) in ARMS.items()), *UPCYCLE_ARMS.items()]:
            if arm not in arms:
                continue
            seeds = arms[arm]
            loss = summary([r["val_loss"] for r in seeds.values()])
            first = next(iter(seeds.values()))
            d = list(paired(arms, arm, "dense").values())
            delta = f"{statistics.mean(d):+.4f} +- {statistics.stdev(d) if len(d) > 1 else 0:.4f}" if d and arm != "dense" else "-"
            speed = statistics.median(r["tokens_per_cpu_s"] for r in seeds.values() if r["tokens_per_cpu_s"])
            ends = [r["curve"][-1] for r in seeds.values()]
            dropped = [p["dropped"] for p in ends if "dropped" in p]
            load = [(r["curve"][-1]["load_max_over_mean"],
                     statistics.mean(p["load_max_over_mean"] for p in r["curve"] if "load_max_over_mean" in p))
                    for r in seeds.values() if "load_max_over_mean" in r["curve"][-1]]
            lines.append(
                f"| {arm} | {what} | {first['params']['total'] / 1e6:.2f}M / {first['params']['active'] / 1e6:.2f}M "
                f"| {first['flops_per_token']['train'] / 1e6:.2f} | {loss['n']} | {loss['mean']:.4f} | {loss['std']:.4f} "
                f"| {loss['min']:.4f} - {loss['max']:.4f} | {delta} | {speed:,.0f} "
                f"| {f'{statistics.mean(dropped):.3f}' if dropped else '-'} "
                f"| {f'{statistics.mean(a for a, _ in load):.2f} ({statistics.mean(b for _, b in load):.2f})' if load else '-'} |"
            )
        lines += ["", "Claims (paired one-sided t-test at 5% over seeds; 'null': the spread does not resolve the sign):", "",
                  "| claim | arm - baseline, per seed | mean +- std | verdict |", "|---|---|---|---|"]
        for claim, arm, baseline in CLAIMS:
            d = list(paired(arms, arm, baseline).values())
            if d:
                lines.append(f"| {claim} | {', '.join(f'{x:+.4f}' for x in d)} | {statistics.mean(d):+.4f} +- "
                             f"{statistics.stdev(d) if len(d) > 1 else 0:.4f} | {verdict(d)} |")
    curve = curve_summary(results) if budgets else {"claims": {}}
    if any(curve["claims"].values()):
        lines += ["", "## The demo's claims against the budget (its rule: every seed lower and mean > 2 sd)", "",
                  "| claim | tokens per run | arm - baseline, per seed | mean | sd | seeds lower | verdict | "
                  "sets of a demo's seed count that hold |", "|---|---|---|---|---|---|---|---|"]
        for claim, points in curve["claims"].items():
            for p in points:
                lines.append(f"| {claim} | {p['tokens'] / 1e6:.2f}M | {', '.join(f'{v:+.4f}' for v in p['per_seed'].values())} "
                             f"| {p['mean']:+.4f} | {p['std']:.4f} | {p['agree']} of {len(p['per_seed'])} | {p['verdict']} "
                             f"| {p['subsets']['holds']} of {p['subsets']['of']} (sets of {p['subsets']['size']}) |")
    noise = evaluation_noise(budgets)
    if noise:
        lines += ["", "## Evaluation noise (bootstrap standard error of the paired difference over held-out windows)", "",
                  "| steps | claim | seed | " + " | ".join(f"{n} windows: difference (se)" for n in NOISE_BLOCKS) + " |",
                  "|---|---|---|" + "---|" * len(NOISE_BLOCKS)]
        for row in noise:
            lines.append(f"| {row['steps']} | {row['claim']} | {row['seed']} | "
                         + " | ".join(f"{row[n]['difference']:+.4f} ({row[n]['se']:.4f})" for n in NOISE_BLOCKS) + " |")
    results_path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if budgets:
        plot(budgets, results_path.with_suffix(".png"), name, s["batch"] * s["block"])


def plot(budgets: dict, path: Path, name: str, tokens_per_step: int) -> None:
    """Held-out loss against tokens and against training FLOPs of the longest budget's runs (mean over seeds,
    min-max band; log scale, so that no curve's start is cut off), their paired difference to dense, and the demo's
    claims against the budget (each seed its own colour)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def band(ax, records, x="tokens", minus=None, **style):  # x: "tokens" or "flops" (tokens x training FLOPs per token)
        per_token = records[0]["flops_per_token"]["train"] if x == "flops" else 1
        xs = [p["tokens"] * per_token for p in records[0]["curve"]]
        ys = [[p["val_loss"] - (m["curve"][i]["val_loss"] if m else 0) for i, p in enumerate(r["curve"])]
              for r, m in zip(records, minus or [None] * len(records))]
        ax.plot(xs, [statistics.mean(col) for col in zip(*ys)], **style)
        if len(ys) > 1:
            ax.fill_between(xs, [min(col) for col in zip(*ys)], [max(col) for col in zip(*ys)], alpha=0.15,
                            color=ax.lines[-1].get_color())

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    arms = budgets[max(budgets)]
    for arm in [*ARMS, *UPCYCLE_ARMS]:
        if arm not in arms:
            continue
        records = list(arms[arm].values())
        band(axes[0, 0], records, label=arm)
        band(axes[0, 1], records, x="flops", label=arm)
        if arm != "dense" and "dense" in arms:
            seeds = sorted(set(arms[arm]) & set(arms["dense"]))
            start = arms[arm][seeds[0]]["curve"][0]["step"]  # an upcycled run starts at half the budget
            dense = [{"curve": [p for p in arms["dense"][i]["curve"] if p["step"] >= start]} for i in seeds]
            band(axes[1, 0], [arms[arm][i] for i in seeds], minus=dense, label=arm)
    for ax in axes[0]:
        ax.set_yscale("log")
    colours = plt.get_cmap("tab10").colors
    for claim, style in zip(DEMO_CLAIMS, ("-", "--")):
        arm, baseline = DEMO_CLAIMS[claim]
        tokens = [(b * tokens_per_step, b) for b in budgets]
        diffs = {b: paired(budgets[b], arm, baseline) for b in budgets}
        seeds = sorted({seed for d in diffs.values() for seed in d})
        for n, seed in enumerate(seeds):
            xs = [x for x, b in tokens if seed in diffs[b]]
            axes[1, 1].plot(xs, [diffs[b][seed] for _, b in tokens if seed in diffs[b]], style, marker=".",
                            color=colours[n % len(colours)], linewidth=0.9, label=f"seed {seed}" if style == "-" else None)
        means = [(x, statistics.mean(diffs[b].values())) for x, b in tokens if diffs[b]]
        if means:
            axes[1, 1].plot(*zip(*means), style, color="black", linewidth=2.2, label=f"{claim}: mean")
    axes[1, 1].set_xscale("log")
    titles = [("held-out loss vs training tokens (longest budget)", "tokens", "held-out loss (log scale)"),
              ("held-out loss vs training FLOPs (analytic)", "FLOPs", "held-out loss (log scale)"),
              ("paired difference to dense (same seed), < 0: better", "tokens", "held-out loss - dense's"),
              ("the demo's claims at each budget (solid: from scratch, dashed: upcycled)", "tokens per run",
               "arm - dense, final held-out loss")]
    for ax, (title, xlabel, ylabel) in zip(axes.flat, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.axhline(0, color="black", lw=0.8)
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
    parser.add_argument("--curve", action="store_true", help=f"the demo's budget curve: arms dense and top2_e4 (and "
                        f"upcycling) at {CURVE_BUDGETS} steps, seeds 0-4, into quality_<setting>_curve.json")
    parser.add_argument("--seeds", type=int, help="seeds 0..N-1 (default: the setting's)")
    parser.add_argument("--seed_list", type=int, nargs="+", help="these seeds instead of --seeds")
    parser.add_argument("--budgets", type=int, nargs="+", help="budgets in steps (default: the setting's)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="a subset of the arms (default: the setting's)")
    parser.add_argument("--results", type=Path, help="results JSON (default benchmarks/results/quality_<setting>.json)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/hf-ppmoe-quality"), help="corpus cache, checkpoints")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    parser.add_argument("--noise", action="store_true", help="record per-window final losses (evaluation noise)")
    parser.add_argument("--no_upcycling", action="store_true", help="no upcycling arm beside the dense arm")
    for flag in ("lr", "warmup", "batch"):  # benchmarks/PROTOCOL.md R5: the tuning runs only
        parser.add_argument(f"--{flag}", type=float if flag == "lr" else int, help=f"tuning only: the setting's {flag}")
    parser.add_argument("--report", action="store_true", help="only rewrite the report from the results JSON")
    args = parser.parse_args(argv)
    name = args.setting or "cpu"
    s = SETTINGS[name]
    s = dataclasses.replace(s, **{f: getattr(args, f) for f in ("lr", "warmup", "batch") if getattr(args, f) is not None})
    if s.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--full runs on a CUDA GPU and none is available here; the default setting runs on the CPU.")
    torch.set_num_threads(args.threads)
    results_path = args.results or RESULTS / f"quality_{name}{'_curve' if args.curve else ''}.json"
    if args.report:
        write_report(json.loads(results_path.read_text()), name, results_path)
        return []
    results_path.parent.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    seeds = args.seed_list or list(range(args.seeds or (5 if args.curve else s.seeds)))
    arms = args.arms or (["dense", "top2_e4"] if args.curve else list(s.arms or ARMS))
    budgets = args.budgets or (CURVE_BUDGETS if args.curve else [s.steps])
    return run_all(s, name, results_path, args.work, seeds, arms, budgets, noise=args.noise,
                   upcycling=not args.no_upcycling)


if __name__ == "__main__":
    main(sys.argv[1:])
