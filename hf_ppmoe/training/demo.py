"""`hf-ppmoe demo`: the main job of the README, end to end on the built-in corpus (no download).

1. split the Python language reference that ships with CPython into training topics and a named held-out set, and
   train a small dense GPT-2 on the training topics;
2. upcycle it to a GPT-MoE and check that its logits equal the dense model's; count total and active parameters;
3. fine-tune the MoE and, for the same steps on the same batches, the dense model, for several data-order seeds;
   compare their held-out loss per seed (the claim is made only if every seed agrees) and their tokens/s; and, the
   papers' comparison, against a dense GPT-2 with the MoE's active parameters (equal FLOPs per token) trained from
   scratch for as many steps as the MoE saw in all;
4. measure the share of routes each expert receives in each MoE layer on the held-out set, before and after;
5. generate with GShard flat beam search (and check it equals Transformers' beam search);
6. merge the MoE's experts back into a plain GPT-2 and evaluate it on the same held-out set;
7. write a report (markdown + PNG plots) and print where it is.
Every stage is the library's public API: `hf_ppmoe.training.main`, `upcycle`, `flat_beam_search`, `merge_experts`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GPT2Config

from ..conversion import merge_experts, upcycle
from ..generation import flat_beam_search
from ..modeling.loss import lm_loss_of
from ..moe.layer import MoELayer
from .demo_arguments import DemoArguments
from .data import builtin_corpus, pack, train_tokenizer
from .demo_runs import data_order_seeds, median_tokens_per_second, records, train_run, write_jsonl
from .tracking import plot_expert_share, plot_paired_runs

PROMPT = "The while statement"
HELD_OUT_EVERY = 10  # every 10th topic of the language reference (alphabetical order, from the first) is held out

QUICK = dict(dense_steps=4, finetune_steps=4, seeds=2, batch_size=16, block_size=32, hidden_size=32, num_layers=2,
             num_experts=4, num_beams=2, evaluations=2, eval_pairs=4)


def _train(args: DemoArguments, root: Path, out: str, steps: int, seed: int, logging_steps: int, **model) -> dict:
    return train_run(args, root, out, steps, seed, logging_steps, block_size=args.block_size, **model)


@torch.no_grad()
def _lm_loss(model, blocks: torch.Tensor, batch_size: int) -> float:
    """Next-token cross-entropy alone (the output's `lm_loss`: an MoE's `loss` also carries its router losses),
    token-weighted over `blocks`; the same quantity as the training loop's eval/loss."""
    total, tokens = 0.0, 0
    for i in range(0, len(blocks), batch_size):
        batch = blocks[i : i + batch_size]
        lm_loss, count = lm_loss_of(model(batch, labels=batch), batch, causal=True)
        total, tokens = total + lm_loss.item() * count.item(), tokens + count.item()
    return total / tokens


@torch.no_grad()
def expert_shares(model, blocks: torch.Tensor, batch_size: int) -> dict[str, list[float]]:
    """Per MoE layer, the share of all routes (tokens x k) that each expert receives on `blocks`."""
    names = [name for name, m in model.named_modules() if isinstance(m, MoELayer)]
    E = model.config.num_experts
    counts = torch.zeros(len(names), E)
    for i in range(0, len(blocks), batch_size):
        ids = model(blocks[i : i + batch_size], output_router_logits=True).router_expert_ids
        counts += torch.stack([torch.bincount(layer.flatten(), minlength=E + 1)[:E].float() for layer in ids])
    shares = counts / counts.sum(1, keepdim=True)
    return {"layer " + name.split(".")[-2]: row.tolist() for name, row in zip(names, shares)}


def _verdict(diffs: list[float]) -> str:
    """What the per-seed held-out differences (MoE minus dense) support, and nothing more: a difference is claimed
    only when every seed has the same sign and the mean is more than twice the seeds' standard deviation from 0."""
    listed = ", ".join(f"{d:+.4f}" for d in diffs)
    if len(diffs) == 1:
        return (f"MoE minus dense: {listed} nats from one seed; with one seed there is no spread to compare it with, "
                "so no difference is claimed (run with --seeds 3).")
    mean, spread = statistics.mean(diffs), statistics.stdev(diffs)
    stats = f"MoE minus dense per seed: {listed} nats (mean {mean:+.4f}, standard deviation {spread:.4f} over {len(diffs)} seeds)"
    if abs(mean) <= 2 * spread or not (all(d < 0 for d in diffs) or all(d > 0 for d in diffs)):
        return f"{stats}: the difference is within the spread of the seeds at this size, so none is claimed."
    if mean < 0:
        return f"{stats}: the upcycled MoE ends lower in every seed, by {-max(diffs):.4f} to {-min(diffs):.4f} nats."
    return f"{stats}: the dense model ends lower in every seed; the MoE does not pay off at this size and budget."


def _held_out(texts: list[str]) -> tuple[list[str], list[str], list[str], int]:
    """(training topics, held-out topics, held-out topic names, distinct topics): of the corpus' distinct texts (two
    topics share one), every HELD_OUT_EVERY-th is held out."""
    from pydoc_data.topics import topics

    distinct: dict[str, str] = {}
    for name, text in zip(sorted(topics), texts):  # sorted(topics) is the order of builtin_corpus()
        distinct.setdefault(text, name)
    texts, names = list(distinct), list(distinct.values())
    held = range(0, len(texts), HELD_OUT_EVERY)
    return ([t for i, t in enumerate(texts) if i % HELD_OUT_EVERY], [texts[i] for i in held], [names[i] for i in held],
            len(texts))


def _millions(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def run_demo(args: DemoArguments) -> Path:
    if args.quick:
        args = dataclasses.replace(args, **QUICK)
    if args.seq2seq:
        from .demo_seq2seq import run_seq2seq_demo

        return run_seq2seq_demo(args)
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    start, load = time.perf_counter(), os.getloadavg()
    times = {}
    torch.manual_seed(args.seed)
    corpus = builtin_corpus()
    train_texts, held_texts, held_names, distinct = _held_out(corpus)
    write_jsonl(root / "data" / "train.jsonl", [{"text": t} for t in train_texts])
    write_jsonl(root / "data" / "held-out.jsonl", [{"text": t} for t in held_texts])
    tokenizer = train_tokenizer(train_texts)
    tokenizer.save_pretrained(root / "tokenizer")
    held_out = pack(held_texts, tokenizer, args.block_size)  # the blocks the training loop evaluates on
    train_tokens = pack(train_texts, tokenizer, args.block_size).numel()
    tokens_per_step = args.batch_size * args.block_size

    print(f"[1/7] dense GPT-2 pre-training ({args.dense_steps} steps)")
    clock = time.perf_counter()
    gpt2 = dict(
        vocab_size=len(tokenizer), n_embd=args.hidden_size, n_layer=args.num_layers, n_head=max(1, args.hidden_size // 32),
        n_positions=args.block_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    GPT2Config(**gpt2).to_json_file(root / "dense_config.json")
    # the papers' comparison: a GPT-2 with the MoE's active parameters, its FFN widened by the k - 1 routes per token
    # that the MoE adds in one FFN of every moe_layer_frequency (equal FLOPs per token, router aside)
    wide = round(4 * args.hidden_size * (1 + (args.num_experts_per_tok - 1) / args.moe_layer_frequency))
    GPT2Config(**gpt2, n_inner=wide).to_json_file(root / "dense_active_config.json")
    dense_eval = _train(args, root, "dense", args.dense_steps, args.seed, max(1, args.dense_steps // 50),
                        config_name=str(root / "dense_config.json"))["eval/loss"]
    times["dense pre-training"] = time.perf_counter() - clock

    k = args.num_experts_per_tok
    layers = "every FFN" if args.moe_layer_frequency == 1 else f"one FFN in {args.moe_layer_frequency}"
    gate = f"gate `topk` (each token goes to the {k} experts its router scores highest, their weights renormalized)"
    print(f"[2/7] upcycling to a GPT-MoE: {args.num_experts} experts, top-{k}, {layers}; the router starts random")
    clock = time.perf_counter()
    dense = AutoModelForCausalLM.from_pretrained(root / "dense").eval()
    upcycle(root / "dense", num_experts=args.num_experts, num_experts_per_tok=k, router_type="topk",  # = `gate`
            router_init="random", moe_layer_frequency=args.moe_layer_frequency, seed=args.seed,
            save_directory=root / "moe-init", overwrite=True)
    moe = AutoModelForCausalLM.from_pretrained(root / "moe-init").eval()
    probe = held_out[: args.batch_size]
    with torch.no_grad():
        gap = (moe(probe).logits - dense(probe).logits).abs().max().item()
    dense_total, moe_total, moe_active = dense.num_parameters(), moe.num_parameters(), moe.num_active_parameters()
    share_init = expert_shares(moe, held_out, args.batch_size)
    print(f"      max |logit difference| between the upcycled MoE and the dense model: {gap:.2e}")
    print(f"      parameters: dense {_millions(dense_total)}; MoE {_millions(moe_total)} total, "
          f"{_millions(moe_active)} active per token")
    times["upcycling"] = time.perf_counter() - clock

    seeds = data_order_seeds(args)
    print(f"[3/7] fine-tuning the MoE and the dense model, {args.finetune_steps} steps on the same batches, seeds {seeds}")
    clock, load_before = time.perf_counter(), os.getloadavg()[0]
    results, equal_flops = {"moe": [], "dense": []}, []
    total_steps = args.dense_steps + args.finetune_steps
    for seed in seeds:  # interleaved, so that a change in the machine's load hits every model alike
        results["moe"].append(_train(args, root, f"finetune/moe-seed{seed}", args.finetune_steps, seed, 1,
                                     model_name_or_path=str(root / "moe-init"))["eval/loss"])
        results["dense"].append(_train(args, root, f"finetune/dense-seed{seed}", args.finetune_steps, seed, 1,
                                       model_name_or_path=str(root / "dense"))["eval/loss"])
        equal_flops.append(_train(args, root, f"equal-flops/dense-seed{seed}", total_steps, seed, 1,
                                  config_name=str(root / "dense_active_config.json"))["eval/loss"])
        print(f"      seed {seed}: held-out loss MoE {results['moe'][-1]:.4f}, dense {results['dense'][-1]:.4f}, dense "
              f"with the MoE's active parameters (from scratch, {total_steps} steps) {equal_flops[-1]:.4f}")
    diffs = [m - d for m, d in zip(results["moe"], results["dense"])]
    verdict = _verdict(diffs)
    print(f"      {verdict}")
    logs = {name: [records(root, f"finetune/{name}-seed{seed}") for seed in seeds] for name in results}
    speed = {name: median_tokens_per_second(records) for name, records in logs.items()}
    speed["equal-flops"] = median_tokens_per_second([records(root, f"equal-flops/dense-seed{seed}") for seed in seeds])
    flops_verdict = _verdict([m - d for m, d in zip(results["moe"], equal_flops)])
    wide_total = AutoModelForCausalLM.from_pretrained(root / f"equal-flops/dense-seed{seeds[0]}").num_parameters()
    print(f"      against the dense model with the MoE's active parameters: {flops_verdict}")
    times["fine-tuning"] = time.perf_counter() - clock
    load_after = os.getloadavg()[0]

    print("[4/7] expert token shares on the held-out set")
    clock = time.perf_counter()
    moe = AutoModelForCausalLM.from_pretrained(root / f"finetune/moe-seed{seeds[0]}").eval()
    share_tuned = expert_shares(moe, held_out, args.batch_size)
    spread = {title: (min(min(r) for r in s.values()), max(max(r) for r in s.values()))
              for title, s in (("init", share_init), ("tuned", share_tuned))}

    print(f"[5/7] generating with flat beam search ({args.num_beams} beams)")
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    new_tokens = min(30, args.block_size - prompt.shape[1])  # the model has block_size positions
    # no 3 tokens twice: the continuation cannot loop (a penalty on repeated tokens alone let it emit 29 newlines)
    kw = dict(num_beams=args.num_beams, max_new_tokens=new_tokens, no_repeat_ngram_size=3, min_new_tokens=new_tokens,
              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    flat = moe.generate(prompt, custom_generate=flat_beam_search, **kw)
    same = torch.equal(flat, moe.generate(prompt, **kw))
    text = tokenizer.decode(flat[0], skip_special_tokens=True)
    print(f"      {text!r}\n      identical to Transformers' beam search: {same}")

    print("[6/7] merging the experts back into a plain GPT-2 (router-usage-weighted mean)")
    merged = merge_experts(root / f"finetune/moe-seed{seeds[0]}", method="usage", sample_texts=train_texts[:20],
                           tokenizer=tokenizer, save_directory=root / "merged", overwrite=True)
    merged = AutoModelForCausalLM.from_pretrained(merged).eval()
    merged_loss = _lm_loss(merged, held_out, args.batch_size)
    moe_loss = _lm_loss(moe, held_out, args.batch_size)
    print(f"      {type(merged).__name__}: held-out loss {merged_loss:.4f} (the MoE it came from: {moe_loss:.4f})")

    times["expert shares, generation, merging"] = time.perf_counter() - clock
    if merged_loss > moe_loss:
        merge_note = ("Averaging keeps what the experts share and loses what they learned apart "
                      f"({merged_loss - moe_loss:.4f} nats here).")
    else:
        merge_note = "The merged model is no worse than the MoE here."
    print("[7/7] writing the report")
    plot_paired_runs({"MoE": logs["moe"], "dense": logs["dense"]}, root / "training.png", records(root, "dense"))
    plot_expert_share({f"upcycled, before fine-tuning ({args.num_experts} experts, top-{k})": share_init,
                       f"after {args.finetune_steps} fine-tuning steps (seed {seeds[0]})": share_tuned},
                      root / "expert_share.png")
    minutes = (time.perf_counter() - start) / 60
    stage_times = ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in times.items())
    epochs = (args.dense_steps + args.finetune_steps) * tokens_per_step / train_tokens
    perplexity = math.exp(results["moe"][0])
    flops_rows = "\n".join(f"| {seed} | {m:.4f} | {d:.4f} | {m - d:+.4f} |"
                           for seed, m, d in zip(seeds, results["moe"], equal_flops, strict=True))
    rows = "\n".join(f"| {seed} | {m:.4f} | {d:.4f} | {m - d:+.4f} |"
                     for seed, m, d in zip(seeds, results["moe"], results["dense"], strict=True))
    quick = "\n*`--quick`: tiny models and a few steps, a check that every stage runs; the numbers are not a result.*\n"
    moe_row = f"{_millions(moe_total)} ({moe_total / dense_total:.2f}x) | {_millions(moe_active)} ({moe_active / dense_total:.2f}x)"
    exact = "equal up to float32 rounding" if gap < 1e-4 else "NOT equal: upcycling went wrong"
    report = f"""# hf-ppmoe demo
{quick if args.quick else ""}
## Data

The Python language reference that ships with CPython (`pydoc_data.topics`, no download: {len(corpus)} topics,
{distinct} distinct texts). **Held-out set**: every {HELD_OUT_EVERY}th distinct topic in alphabetical order, from the first:
{", ".join(f"`{n}`" for n in held_names)} ({len(held_texts)} topics, {held_out.numel():,} tokens in
{len(held_out)} blocks of {args.block_size}). No model trains on them, the tokenizer (byte-level BPE, {len(tokenizer)}
tokens) is fitted without them, and every loss below called "held-out" is the next-token cross-entropy (nats per
token, router losses excluded) on these blocks. The other {len(train_texts)} topics ({train_tokens:,} tokens) are the
training set; steps are {args.batch_size} sequences of {args.block_size} tokens.

## Models

| model | parameters | active per token |
|---|---|---|
| dense GPT-2, {args.num_layers} layers, hidden {args.hidden_size} | {_millions(dense_total)} | {_millions(dense_total)} |
| upcycled GPT-MoE, {args.num_experts} experts top-{k} in {layers} | {moe_row} |
| dense GPT-2, FFN {wide} wide (the MoE's active parameters) | {_millions(wide_total)} | {_millions(wide_total)} |

Upcycling copies the dense FFN into every expert and adds a router per MoE layer: {gate}. The router starts random
(`router_init="random"`, seed {args.seed}) and learns which experts to use during fine-tuning; while the experts are
identical copies whose weights sum to 1, the MoE computes the dense model's function whatever the router picks: max
|logit difference| between the fresh MoE and the dense model on {len(probe)} held-out blocks = {gap:.2e} ({exact}).

## Equal FLOPs per token: the MoE against a dense model of its active parameters

The papers' comparison. A GPT-2 whose FFN is {wide} wide has the upcycled MoE's active parameters per token (router
aside: {_millions(wide_total)} against {_millions(moe_active)}); it trains from scratch for {total_steps} steps, as many
as the MoE saw in pre-training and fine-tuning, with each seed's data order. Per token both compute the same; over the
run the dense model computes more, since the MoE's first {args.dense_steps} steps were the small dense model's:

| seed | MoE held-out loss | dense (equal active parameters) held-out loss | MoE minus dense |
|---|---|---|---|
{flops_rows}

{flops_verdict} Speed (median step, CPU proxy): MoE {speed['moe']:,.0f} tokens/s, dense with the MoE's active
parameters {speed['equal-flops']:,.0f} tokens/s.

## Dense pre-training, then fine-tuning both models

The dense model trains {args.dense_steps} steps (held-out loss {dense_eval:.4f}). From there, the upcycled MoE and the
dense model each train {args.finetune_steps} more steps with the same schedule on the same batches, once per
data-order seed:

| seed | MoE held-out loss | dense held-out loss | MoE minus dense |
|---|---|---|---|
{rows}

{verdict}

Speed (median step of the fine-tuning runs above, the two models' runs interleaved on this machine, {os.cpu_count()}
cores, 1-min load average {load_before:.1f} before and {load_after:.1f} after them): MoE {speed['moe']:,.0f} tokens/s,
dense {speed['dense']:,.0f} tokens/s ({speed['moe'] / speed['dense']:.2f}x). The
comparison is at equal steps and equal data, not at equal compute: the MoE computes with
{moe_active / dense_total:.2f}x the dense model's active parameters per token.

![training](training.png)

Left: dense pre-training. Middle: the fine-tuning phase, mean over seeds (train loss as a 10-step moving average).
Right: MoE minus dense on the same batch, per step (thin: each seed; thick: their mean, 10-step average) and on the
held-out set (dots).

## Where the tokens go

Share of routes (tokens x {k}) that each expert receives in each MoE layer, on the held-out set; uniform would be
{100 / args.num_experts:.1f}%. Freshly upcycled (random router): {100 * spread['init'][0]:.1f}% to
{100 * spread['init'][1]:.1f}%; after fine-tuning: {100 * spread['tuned'][0]:.1f}% to {100 * spread['tuned'][1]:.1f}%.

![expert share](expert_share.png)

## Generation

Flat beam search ({args.num_beams} beams, GShard appendix A.5) with the seed-{seeds[0]} MoE from "{PROMPT}":

> {text!r}

Identical to Transformers' beam search: {same}. Why it reads as it does: the model has {_millions(moe_total)}
parameters, has seen the training set {epochs:.2g} times ({args.dense_steps + args.finetune_steps} steps), and its
held-out perplexity is {perplexity:.0f} (exp of {results['moe'][0]:.4f}): on average it is as unsure of the next token
as a uniform choice among {perplexity:.0f}. That is enough to pick up frequent words, markup and code fragments of the
corpus, not to follow a thought, and beam search, which returns the most probable continuation, tends to favour generic
and repeated phrases; no_repeat_ngram_size=3 (no three tokens twice) keeps it from looping.

## Merging back into GPT-2

The seed-{seeds[0]} MoE's experts merged into a plain `{type(merged).__name__}` (router-usage-weighted mean), the
dense model's size again: held-out loss {merged_loss:.4f}, against {moe_loss:.4f} for the MoE it came from and
{results['dense'][0]:.4f} for the dense model fine-tuned on the same batches. {merge_note}

## Run time

{minutes:.1f} minutes in all on {os.cpu_count()} cores (1-min load average {load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at
the end): {stage_times}.

Folders: `data/` (training and held-out topics), `dense/` (GPT-2), `moe-init/` (upcycled),
`finetune/moe-seedN/` and `finetune/dense-seedN/`, `equal-flops/dense-seedN/` (each with `logs/metrics.jsonl`), `merged/` (plain GPT-2, loads
without hf_ppmoe).
"""
    (root / "report.md").write_text(report)
    print(f"done in {minutes:.1f} min: report at {(root / 'report.md').resolve()} (plots: training.png, expert_share.png)")
    return root / "report.md"
