"""What the demos claim and how they say it, in code both demos share: the claims' rule (`judge`, `compare`,
`sentence`), and `publish`, which writes `results.json` and renders `report.md` from that file's content alone, so
that every sentence of a report follows from the file beside it (`environment` and `run_time` are the parts both
reports hold). The GPT demo's claims and report: `claims`, `report_markdown`; the Seq2Seq demo's: `seq2seq.py`."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

CLAIM_RULE = ("A claim holds only when the arm ends below its baseline in every seed AND the mean difference is more "
              "than twice the standard deviation of the per-seed differences; reversed when the same holds the other "
              "way; otherwise it is not shown at this budget.")

# (name, the papers' statement, arm, baseline)
CLAIMS = [
    ("from_scratch", "At equal FLOPs per token and equal training tokens, an MoE reaches a lower held-out loss than "
     "the dense model (GShard, M6-T, PPMoE)", "moe_scratch", "dense"),
    ("upcycling", "From the same dense checkpoint and for the same tokens, the upcycled MoE reaches a lower held-out "
     "loss than continued dense training (Komatsuzaki et al. 2022, sparse upcycling)", "moe_upcycled", "dense"),
    ("parameter_bound", "The MoE comes close to a dense model as wide as all its experts (its parameters, at more "
     "FLOPs); here the claim tested is that the wide dense model ends lower", "dense_wide", "moe_scratch"),
]


def judge(diffs: list[float]) -> str:
    """'holds', 'reversed' or 'not shown' for per-seed differences arm minus baseline (CLAIM_RULE)."""
    if len(diffs) < 2:
        return "not shown"
    mean, std = statistics.mean(diffs), statistics.stdev(diffs)
    if all(d < 0 for d in diffs) and -mean > 2 * std:
        return "holds"
    if all(d > 0 for d in diffs) and mean > 2 * std:
        return "reversed"
    return "not shown"


def compare(mine: dict, theirs: dict, better: str = "lower", unit: str = "nats") -> dict:
    """Per-seed differences of two arms' values ({seed: value}, `better` "lower" or "higher"), their mean and
    standard deviation, how many seeds agree with the claim (the arm `better`), and the verdict (`judge`)."""
    per_seed = {seed: mine[seed] - theirs[seed] for seed in mine if seed in theirs}
    diffs = list(per_seed.values())
    toward = [d if better == "lower" else -d for d in diffs]  # < 0: the arm is better
    return {"per_seed": per_seed, "mean": statistics.mean(diffs), "std": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
            "better": better, "unit": unit, "agree": sum(d < 0 for d in toward), "verdict": judge(toward)}


def claims(arms: dict, tokens: int | None = None, curve: dict | None = None) -> dict:
    """Every claim whose arms ran: per-seed differences, their mean and standard deviation, the verdict; with the
    budget curve measured for this protocol (`budget.CURVE`), what it says at the run's `tokens` ("here") and the
    smallest budget from which on the rule holds for every set of as many curve seeds as a demo runs ("clears_at":
    the budget at which any seeds a user picks should clear it, if they behave like the curve's)."""
    out = {}
    for name, statement, arm, baseline in CLAIMS:
        if arm not in arms or baseline not in arms:
            continue
        out[name] = {"statement": statement, "arm": arm, "baseline": baseline,
                     **compare(arms[arm]["held_out_loss"], arms[baseline]["held_out_loss"])}
        if curve and name in curve["claims"]:
            points = curve["claims"][name]
            clears = None  # the smallest budget from which on every set of seeds holds, at every measured budget
            for p in sorted(points, key=lambda p: -p["tokens"]):
                if p["subsets"]["holds"] < p["subsets"]["of"]:
                    break
                clears = p["tokens"]
            out[name]["curve"] = {"seeds": curve["seeds"], "points": points, "clears_at": clears,
                                  "here": next((p for p in points if p["tokens"] == tokens), None)}
    return out


def sentence(claim: dict) -> str:
    """The verdict in words, with the numbers behind it."""
    listed = ", ".join(f"{d:+.4f}" for d in claim["per_seed"].values())
    n, better = len(claim["per_seed"]), claim["better"]
    worse = "higher" if better == "lower" else "lower"
    numbers = (f"{claim['arm']} minus {claim['baseline']} per seed: {listed} {claim['unit']} (mean {claim['mean']:+.4f}, "
               f"standard deviation {claim['std']:.4f}; {better} in {claim['agree']} of {n} seeds)")
    diffs = list(claim["per_seed"].values())
    if claim["verdict"] == "holds":
        return f"**Holds.** {numbers}: {better} in every seed, by more than twice the spread."
    if claim["verdict"] == "reversed":
        return f"**Reversed.** {numbers}: {worse} in every seed, by more than twice the spread."
    if n < 2:
        why = "one seed has no spread to compare with (run with --seeds 3)"
    elif all(d < 0 for d in diffs) or all(d > 0 for d in diffs):
        why = "every seed agrees on the sign, but the mean is within twice the spread of the seeds"
    else:
        why = "the seeds disagree on the sign"
    return f"**Not shown at this budget.** {numbers}: {why}, so no difference is claimed."


def environment(load_start: float) -> dict:
    """The machine and versions a demo ran on, and the 1-min load average at its start and end."""
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(), "load_start": load_start,
            "load_end": os.getloadavg()[0]}


def run_time(r: dict) -> str:
    """The report's run-time sentence: minutes, cores, runs side by side, load, stages and versions."""
    env = r["environment"]
    side = f", {r['workers']} runs side by side" if "workers" in r else ""
    return (f"{r['run_time_min']:.1f} minutes on {env['cores']} CPU cores{side} (1-min load average "
            f"{env['load_start']:.1f} at the start, {env['load_end']:.1f} at the end): "
            + ", ".join(f"{k} {v / 60:.1f} min" for k, v in r["stages_s"].items())
            + f". Python {env['python']}, torch {env['torch']}, transformers {env['transformers']}.")


def publish(root: Path, results: dict, render: Callable[[dict], str]) -> Path:
    """Write `results` to root/results.json, then root/report.md as `render` makes it from that file's content."""
    (root / "results.json").write_text(json.dumps(results, indent=1))
    (root / "report.md").write_text(render(json.loads((root / "results.json").read_text())))
    return root / "report.md"


def budget_sentence(claim: dict) -> str:
    """What the budget curve (more seeds, several budgets) says about the claim at this run's budget, and from which
    budget on the rule holds for any seeds."""
    c = claim.get("curve")
    if c is None:
        return "No budget curve was measured for this setting."
    n, size = len(c["seeds"]), c["points"][0]["subsets"]["size"]
    seeds = ", ".join(map(str, c["seeds"]))
    here = c["here"]
    said = (f"The budget curve (seeds {seeds}; benchmarks/RESULTS.md) at this budget: lower in {here['agree']} of "
            f"{n} (mean {here['mean']:+.4f}, sd {here['std']:.4f}); the rule holds for {here['subsets']['holds']} of the "
            f"{here['subsets']['of']} sets of {size} of them. " if here else
            f"The budget curve (seeds {seeds}; benchmarks/RESULTS.md) has no point at this budget. ")
    largest = max(p["tokens"] for p in c["points"])
    if c["clears_at"] is None:
        best = max(c["points"], key=lambda p: p["subsets"]["holds"])
        lower, runs = sum(p["agree"] for p in c["points"]), sum(len(p["per_seed"]) for p in c["points"])
        return said + (f"No budget it measured (up to {largest / 1e6:.2f}M tokens per run) clears the rule for every "
                       f"set of {size} seeds; the most sets hold at {best['tokens'] / 1e6:.2f}M "
                       f"({best['subsets']['holds']} of {best['subsets']['of']}). The arm ends lower in {lower} of the "
                       f"curve's {runs} runs.")
    if here and c["clears_at"] <= here["tokens"]:
        return said + f"Any {size} seeds should clear it here."
    return said + (f"From {c['clears_at'] / 1e6:.2f}M tokens per run on (up to {largest / 1e6:.2f}M measured), every set "
                   f"of {size} clears it: `hf-ppmoe demo --tokens {c['clears_at']}`.")


def _millions(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def _arm_rows(r: dict) -> str:
    dense = r["arms"]["dense"]["flops_per_token"]
    rows = []
    for name, a in r["arms"].items():
        rows.append(f"| `{name}` | {a['description']} | {_millions(a['params_total'])} | {_millions(a['params_active'])} "
                    f"| {a['flops_per_token'] / 1e6:.3f} ({a['flops_per_token'] / dense:.3f}x) | {a['train_tokens']:,} | "
                    + " | ".join(f"{v:.4f}" for v in a["held_out_loss"].values()) + " |")
    return "\n".join(rows)


def report_markdown(r: dict) -> str:
    """report.md from results.json's content `r`."""
    p, env, arms = r["protocol"], r["environment"], r["arms"]
    s, seeds = p["setting"], p["seeds"]
    quick = "\n*`--quick`: tiny models and a few steps, a check that every stage runs; the numbers are not a result.*\n"
    c = r["claims"]
    dense, moe = arms["dense"], arms["moe_scratch"]
    router_share = (moe["flops_per_token"] - dense["flops_per_token"]) / dense["flops_per_token"]
    speed = r["speed"]
    speed_rows = "\n".join(
        f"| `{name}` | {v['tokens_per_s']:,.0f} | {v['time_ratio']:.2f}x ({v['time_ratio_range'][0]:.2f}-"
        f"{v['time_ratio_range'][1]:.2f}) | {arms[name]['flops_per_token'] / dense['flops_per_token']:.2f}x |"
        for name, v in speed["models"].items())
    shares = r["expert_shares"]
    g, m = r["generation"], r["merged"]
    first = str(seeds[0])
    held = p["held_out"]
    tokens = s["steps"] * s["batch"] * s["block"]
    budget = (f"{tokens / 1e6:.2f}M training tokens per run ({s['steps']} steps"
              + (", the protocol's budget)" if s["steps"] == p["default_steps"] else f", set by --tokens; the protocol's "
                 f"budget is {p['default_steps']} steps)"))
    lines = ["# hf-ppmoe demo: MoE against dense, at equal compute", quick if p["quick"] else "",
             "## What the papers claim, and what this run shows", "", f"At {budget}, {len(seeds)} seeds:", ""]
    for name, claim in c.items():
        lines += [f"- {claim['statement']}. {sentence(claim)} {budget_sentence(claim)}"]
    lines += ["", f"{CLAIM_RULE} Every number is in `results.json` beside this report.", "",
              "## The protocol (fixed before any of its claim seeds ran: benchmarks/PROTOCOL.md)", "",
              f"- **Rule for the hyper-parameters**: {p['rule']}",
              f"- **Data**: the .py files of the CPython {env['python']} standard library (no download). Held-out: "
              f"{held['rule']}: {held['files']} files, {held['tokens']:,} tokens; the claims' held-out loss is on "
              f"{held['final_blocks']} evenly spaced windows of {s['block']} tokens of them (the curves' points on "
              f"{held['blocks']}). Training: {p['train_files']} other files ({p['train_tokens']:,} tokens); byte-level "
              f"BPE of {p['vocab_size']} fitted on the first {p['tokenizer_bytes'] / 1e6:.0f} MB of them.",
              f"- **Models**: GPT-MoE in the Llama layout (rotary, RMSNorm, SwiGLU), hidden {s['hidden']}, {s['layers']} "
              f"layers, {s['heads']} heads; F = {4 * s['hidden']} is the dense FFN's width. Every arm of a seed is built "
              "under the same torch seed.",
              f"- **Training**: {s['steps']} steps of {s['batch']} x {s['block']} tokens, AdamW at peak {s['lr']} "
              f"(warm-up {s['warmup']} steps, constant, then a (1 - sqrt) cool-down to 0 over the last "
              f"{s['decay']:.0%}), the same batches in the same order for every arm of a seed (`data_order` in "
              f"results.json: chained SHA-1 of the batches). The upcycled run starts from the seed's dense run at step "
              f"{s['steps'] // 2} with its optimizer state, and trains the second half on the dense run's batches "
              "and schedule: its baseline is the dense run itself.",
              f"- **Seeds**: {', '.join(map(str, seeds))} (model initialisation and data order); all are shown.",
              "- **Held-out loss**: next-token cross-entropy alone (router losses excluded), nats per token.", "",
              "| arm | what | parameters | active per token | training FLOPs per token (M) | training tokens | "
              + " | ".join(f"held-out loss, seed {seed}" for seed in seeds) + " |",
              "|---|---|---|---|---|---|" + "---|" * len(seeds), _arm_rows(r), "",
              f"FLOPs per token are counted from the configs (2 per multiply-add, training = 3 x forward). "
              f"`moe_scratch` computes what `dense` does plus its routers ({100 * router_share:.2f}% more); the upcycled "
              "MoE runs two full-size experts per token in its MoE layers, so it computes more per token than the dense "
              "model: the upcycling claim is at equal tokens, not equal FLOPs.", "",
              "![held-out loss against training tokens](losses.png)", "",
              "Above: held-out loss against training tokens, each seed thin, the mean thick. Below: the MoE minus "
              "its dense baseline, each seed in its own colour.", "",
              "## Speed", "",
              "Cost per token from the configs is the column above. Measured on this CPU (a proxy: a GPU's ratios "
              f"differ), one thread, the {len(speed['models'])} trained seed-{first} models alternated in "
              f"{speed['rounds']} short rounds of {speed['steps_per_round']} training steps, so that a change in the "
              "machine's load falls on all of them alike; the ratio is the median over rounds of the step time "
              f"against `dense`'s in the same round (range in brackets). 1-min load average {speed['load']:.1f}.", "",
              "| model | tokens/s (best round) | step time vs dense | FLOPs vs dense |", "|---|---|---|---|",
              speed_rows, "",
              "## Where the tokens go", "",
              f"Share of routes (tokens x k) each expert receives in each MoE layer on the held-out set. Freshly "
              f"upcycled (random router): {100 * shares['spread']['upcycled_init'][0]:.1f}% to "
              f"{100 * shares['spread']['upcycled_init'][1]:.1f}%; after training: "
              f"{100 * shares['spread']['upcycled'][0]:.1f}% to {100 * shares['spread']['upcycled'][1]:.1f}%; the "
              f"from-scratch MoE: {100 * shares['spread']['scratch'][0]:.1f}% to "
              f"{100 * shares['spread']['scratch'][1]:.1f}% (uniform: 100% / experts).", "",
              "![expert share](expert_share.png)", "",
              "## Upcycling is exact, generation, and merging back", "",
              f"Right after upcycling, the MoE's logits equal the dense model's: max |difference| "
              f"{r['upcycling']['logit_gap']:.2e} on 2 held-out windows (seed {first}).", "",
              f"Flat beam search ({g['num_beams']} beams, GShard appendix A.5) with the seed-{first} upcycled MoE from "
              f"{g['prompt']!r}:", "", f"> {g['text']!r}", "",
              f"Identical to Transformers' beam search: {g['same']}. The model has {_millions(arms['moe_upcycled']['params_total'])} "
              f"parameters and a held-out perplexity of {math.exp(arms['moe_upcycled']['held_out_loss'][first]):.0f}: "
              "it picks up the corpus' syntax, not its meaning.", "",
              f"The seed-{first} upcycled MoE merged back into a plain `{m['model_class']}` (router-usage-weighted mean "
              f"of the experts): held-out loss {m['loss']:.4f} on the curves' windows, against {m['moe_loss']:.4f} for "
              "the MoE.", "",
              "## Run time and machine", "", run_time(r), "",
              "Folders: `runs/` (one JSON per arm and seed, with its curve), `models/` (every trained model), "
              "`states/` (the dense runs at half the budget, with their optimizer state), `merged/` (a plain "
              "Transformers model), `corpus-*/` (tokenizer and token streams).", ""]
    return "\n".join(lines)
