"""`hf-ppmoe demo`: the papers' case for MoE, measured fairly on the built-in corpus (no download), in named steps
(`run_demo` calls them in this order):

1. `prepare`: the protocol (`protocol.CPU`, or `QUICK`; `--tokens` sets the budget), fixed before any result, written
   to protocol.json and printed; the standard library's .py files split by file, the tokenizer fitted on train files;
2. `train_arms`: per seed, from scratch at equal FLOPs per token and equal tokens, the dense model and the MoE; from
   the dense run at half the budget, the upcycled MoE beside the dense run's second half (and, with
   --parameter_bound, a dense model as wide as all experts); the runs side by side, one CPU thread each;
3. `measure_speed`: the trained models' step times in alternating short rounds (a CPU proxy);
4. `measure_expert_shares`: the share of routes each expert receives, upcycled before and after training, and the
   from-scratch MoE;
5. `generate_text`: GShard flat beam search, checked equal to Transformers' beam search;
6. `merge_back`: the upcycled MoE merged back into a plain Transformers Llama;
7. `write_results`: results.json, report.md and the plots; the claims follow results.json.
Every stage is the library's public API: `upcycle`, `flat_beam_search`, `merge_experts`, `from_pretrained`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ..conversion import merge_experts
from ..generation import flat_beam_search
from ..training.tracking import RouterMonitor
from .budget import curve_for
from .loop import evaluate, held_out_blocks
from .options import DemoArguments
from .plots import plot_comparison, plot_expert_share, spread
from .protocol import CPU, HELD_OUT_EVERY, QUICK, SCRATCH_ARMS, TOKENIZER_BYTES, UPCYCLED, check_blocks, upcycle_from
from .report import CLAIM_RULE, budget_sentence, claims, environment, publish, report_markdown, run_time, sentence
from .runs import Clock, half_state, load_data, paired_speed, quiet, run_all, workers_for

PROMPT = "def read_file(path):\n"
RULE = ("revision 2 of the protocol, fixed by the written rules of benchmarks/PROTOCOL.md before any of its claim seeds "
        "ran: the learning rate, warm-up and batch tuned on the dense model alone, on validation seeds that are never "
        "claim seeds; the MoE's shape from the tokens-per-expert argument, never from its held-out loss; the budget "
        "from the run time; every arm trained alike.")


@torch.no_grad()
def expert_shares(model, blocks: torch.Tensor, batch_size: int) -> dict[str, list[float]]:
    """Per MoE layer, the share of all routes (tokens x k) that each expert receives on `blocks`, as training counts
    them (`RouterMonitor`: the routes each layer's `Routing` reports)."""
    monitor = RouterMonitor(model)
    for i in range(0, len(blocks), batch_size):
        model(blocks[i : i + batch_size], compute_router_losses=True)
    monitor.remove()
    return {"layer " + name.split(".")[-2]: (row / row.sum()).tolist() for name, row in monitor.tokens.items()}


def setting_of(args: DemoArguments):
    """The protocol's setting (`QUICK` with --quick), its budget set by --tokens."""
    s = QUICK if args.quick else CPU
    if not args.tokens:
        return s
    unit = 2 * s.eval_every * s.batch * s.block  # the budget in whole pairs of evaluation intervals: B / 2 is one
    return dataclasses.replace(s, steps=2 * s.eval_every * max(1, round(args.tokens / unit)))


def prepare(args: DemoArguments, root: Path) -> dict:
    """The protocol and the data: returns {"setting", "seeds", "data", "protocol"} and writes protocol.json."""
    s = setting_of(args)
    seeds = [args.seed + i for i in range(args.seeds)]
    print("[1/7] the protocol and the data (the standard library's .py files, split by file)")
    data = load_data(s, root)
    st = data["stats"]
    scratch = [a for a in SCRATCH_ARMS if a != "dense_wide" or args.parameter_bound]
    protocol = {
        "setting": dataclasses.asdict(s), "seeds": seeds, "quick": args.quick, "rule": RULE,
        "default_steps": (QUICK if args.quick else CPU).steps,
        "arms": {**{a: SCRATCH_ARMS[a][0] for a in scratch}, UPCYCLED[0]: UPCYCLED[1]},
        "held_out": {"rule": f"every {HELD_OUT_EVERY}th file in the order of the SHA-1 of its path", "files": len(st["val_files"]),
                     "file_names": st["val_files"], "tokens": st["val_tokens"], "blocks": s.eval_blocks,
                     "final_blocks": s.final_blocks},
        "train_files": len(st["train_files"]), "train_tokens": st["train_tokens"], "vocab_size": st["vocab_size"],
        "tokenizer_bytes": TOKENIZER_BYTES, "claim_rule": CLAIM_RULE,
    }
    (root / "protocol.json").write_text(json.dumps(protocol, indent=1))
    print(f"      fixed before any result: {RULE}")
    print(f"      {s.steps} steps of {s.batch} x {s.block} tokens ({s.tokens() / 1e6:.2f}M tokens per run; the upcycled run "
          f"from step {s.steps // 2}), hidden {s.hidden}, {s.layers} layers, peak lr {s.lr}, warm-up {s.warmup}, "
          f"cool-down over the last {s.decay:.0%}; seeds {seeds}; arms {', '.join(protocol['arms'])}")
    print(f"      held-out: {len(st['val_files'])} files ({st['val_tokens']:,} tokens); training: "
          f"{len(st['train_files'])} files ({st['train_tokens']:,} tokens)")
    return {"setting": s, "seeds": seeds, "data": data, "protocol": protocol, "scratch": scratch}


def train_arms(args: DemoArguments, root: Path, run: dict) -> dict[str, dict]:
    """Every arm for every seed (`runs.run_all`); returns results.json's "arms"."""
    workers = workers_for(args.workers)
    run["workers"] = workers
    s, seeds = run["setting"], run["seeds"]
    print(f"[2/7] training {len(run['scratch']) + 1} arms x {len(seeds)} seeds, {workers} side by side")
    records = run_all(root, s, seeds, run["scratch"], workers)
    arms = {}
    for arm in [*run["scratch"], UPCYCLED[0]]:
        first = records[arm, seeds[0]]
        start = s.tokens(first["steps"]) - first["train_tokens"]  # an upcycled run starts at half the budget
        arms[arm] = {
            "description": run["protocol"]["arms"][arm], "params_total": first["params"]["total"],
            "params_active": first["params"]["active"], "flops_per_token": first["flops_per_token"]["train"],
            "flops_per_token_parts": first["flops_per_token"], "train_tokens": first["train_tokens"],
            "start_tokens": start,
            "held_out_loss": {str(seed): records[arm, seed]["val_loss"] for seed in seeds},
            "curve": {str(seed): [[p["tokens"], p["val_loss"]] for p in records[arm, seed]["curve"] if p["tokens"] >= start]
                      for seed in seeds},  # a run's own points: from its start
            "data_order": {str(seed): records[arm, seed]["data_order"] for seed in seeds},
            "tokens_per_cpu_s": {str(seed): records[arm, seed]["tokens_per_cpu_s"] for seed in seeds},
        }
    run["records"] = records
    return arms


def _model(root: Path, arm: str, seed: int):
    return AutoModelForCausalLM.from_pretrained(root / "models" / f"{arm}-seed{seed}").eval()


def measure_speed(root: Path, run: dict) -> dict:
    """The first seed's trained models, alternated in short rounds on one thread (`runs.paired_speed`)."""
    print("[3/7] speed: the trained models alternated in short rounds (a CPU proxy)")
    first, s = run["seeds"][0], run["setting"]
    names = [a for a in ("dense", "moe_scratch", "moe_upcycled", "dense_wide") if a in run["protocol"]["arms"]]
    batch = held_out_blocks(run["data"], s)[: s.batch]
    rounds, steps = (2, 1) if run["protocol"]["quick"] else (10, 3)
    load = os.getloadavg()[0]
    models = paired_speed({a: _model(root, a, first) for a in names}, batch, rounds=rounds, steps=steps)
    for name, v in models.items():
        print(f"      {name}: {v['tokens_per_s']:,.0f} tokens/s, step time {v['time_ratio']:.2f}x dense's")
    return {"models": models, "rounds": rounds, "steps_per_round": steps, "load": load}


def measure_expert_shares(root: Path, run: dict) -> dict:
    """Expert shares on the held-out set: the upcycled MoE before (its random router) and after training, and the
    from-scratch MoE; and the upcycled model's logit gap to its dense source (the dense run at half the budget)."""
    print("[4/7] expert shares on the held-out set")
    first, s, data = run["seeds"][0], run["setting"], run["data"]
    blocks = held_out_blocks(data, s)
    dense = AutoModelForCausalLM.from_pretrained(half_state(root, first, s))
    fresh, gap = upcycle_from(dense, first, check_blocks(data, s))
    shares = {"upcycled_init": expert_shares(fresh.eval(), blocks, s.batch),
              "upcycled": expert_shares(_model(root, "moe_upcycled", first), blocks, s.batch),
              "scratch": expert_shares(_model(root, "moe_scratch", first), blocks, s.batch)}
    return {"shares": shares, "spread": {k: spread(v) for k, v in shares.items()}, "logit_gap": gap}


def generate_text(args: DemoArguments, root: Path, run: dict) -> dict:
    """Continue PROMPT with flat beam search, and check that Transformers' beam search returns the same tokens."""
    print(f"[5/7] generating with flat beam search ({args.num_beams} beams)")
    tokenizer, moe = run["data"]["tokenizer"], _model(root, "moe_upcycled", run["seeds"][0])
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    new_tokens = min(30, run["setting"].block - prompt.shape[1])  # the model has `block` positions
    # no 3 tokens twice: the continuation cannot loop
    kw = dict(num_beams=args.num_beams, max_new_tokens=new_tokens, no_repeat_ngram_size=3, min_new_tokens=new_tokens,
              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    flat = moe.generate(prompt, custom_generate=flat_beam_search, **kw)
    same = torch.equal(flat, moe.generate(prompt, **kw))
    text = tokenizer.decode(flat[0], skip_special_tokens=True)
    print(f"      {text!r}\n      identical to Transformers' beam search: {same}")
    return {"prompt": PROMPT, "text": text, "same": same, "num_beams": args.num_beams}


def merge_back(root: Path, run: dict) -> dict:
    """Merge the first seed's upcycled MoE into a plain Llama (root/merged/); the held-out loss of both."""
    print("[6/7] merging the upcycled MoE's experts back into a plain Llama (router-usage-weighted mean)")
    first, s, data = run["seeds"][0], run["setting"], run["data"]
    tokenizer = data["tokenizer"]
    samples = [tokenizer.decode(b) for b in data["train"][: 20 * s.block].long().view(20, s.block)]
    path = merge_experts(root / "models" / f"moe_upcycled-seed{first}", method="usage", sample_texts=samples,
                         tokenizer=tokenizer, save_directory=root / "merged", overwrite=True)
    merged = AutoModelForCausalLM.from_pretrained(path).eval()
    blocks = held_out_blocks(data, s)
    result = {"model_class": type(merged).__name__, "loss": evaluate(merged, blocks, s),
              "moe_loss": evaluate(_model(root, "moe_upcycled", first), blocks, s)}
    print(f"      {result['model_class']}: held-out loss {result['loss']:.4f} (the MoE it came from: {result['moe_loss']:.4f})")
    return result


def write_results(root: Path, results: dict, arms: dict, shares: dict) -> Path:
    """The plots, results.json and report.md (rendered from results.json's content: `report.publish`)."""
    print("[7/7] writing results.json, the plots and the report")
    pairs = [("from scratch, equal FLOPs per token", "moe_scratch", "dense"),
             ("upcycled at half the budget, equal tokens", "moe_upcycled", "dense")]
    runs = {arm: {seed: {"curve": [{"tokens": t, "val_loss": v} for t, v in curve]} for seed, curve in a["curve"].items()}
            for arm, a in arms.items()}
    plot_comparison(runs, pairs, root / "losses.png")
    plot_expert_share({"upcycled, random router (before training)": shares["upcycled_init"],
                       "upcycled, after training": shares["upcycled"],
                       "from scratch, after training": shares["scratch"]}, root / "expert_share.png")
    return publish(root, results, report_markdown)


def run_demo(args: DemoArguments) -> Path:
    """Run the demo's steps (the seq2seq demo with --seq2seq); returns the report's path."""
    if args.seq2seq:
        from .seq2seq import run_seq2seq_demo

        return run_seq2seq_demo(args)
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    quiet()
    clock = Clock()
    with clock.stage("data"):
        run = prepare(args, root)
    with clock.stage("training"):
        arms = train_arms(args, root, run)
    verdicts = claims(arms, run["setting"].tokens(), curve_for(run["setting"]))
    for name, claim in verdicts.items():
        print(f"      {name}: {sentence(claim)} {budget_sentence(claim)}")
    with clock.stage("speed, shares, generation, merging"):
        speed = measure_speed(root, run)
        shares = measure_expert_shares(root, run)
        generation = generate_text(args, root, run)
        merged = merge_back(root, run)
    results = {
        "protocol": run["protocol"], "arms": arms, "claims": verdicts, "speed": speed,
        "upcycling": {"logit_gap": shares["logit_gap"]},
        "expert_shares": {"spread": shares["spread"], "layers": shares["shares"]}, "generation": generation,
        "merged": merged, "workers": run["workers"], "stages_s": clock.stages, "run_time_min": clock.minutes(),
        "environment": environment(clock.load[0]),
    }
    path = write_results(root, results, arms, shares["shares"])
    print(f"done: {run_time(results)}\nReport at {path.resolve()} (results.json, losses.png, expert_share.png)")
    return path
