"""The results of `hf-ppmoe demo`'s steps (one small dataclass each, see `demo.py`) and the markdown report that
states them."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .demo_runs import Clock


@dataclass
class Data:
    """The built-in corpus split into training and held-out topics, the tokenizer and the held-out blocks."""

    topics: int  # topics of the language reference
    distinct: int  # distinct texts among them (two topics share one)
    held_out_every: int  # every n-th distinct topic is held out
    train_texts: list[str]
    held_texts: list[str]
    held_names: list[str]
    tokenizer: object
    held_out: torch.Tensor  # the blocks the training loop evaluates on
    train_tokens: int


@dataclass
class Pretrained:
    """The dense GPT-2's held-out loss after pre-training, and the FFN width of a GPT-2 with the MoE's active
    parameters."""

    eval_loss: float
    wide: int


@dataclass
class Upcycled:
    """The freshly upcycled MoE against the dense model it came from."""

    gap: float  # max |logit difference| on the probe blocks
    probe_blocks: int
    dense_total: int
    moe_total: int
    moe_active: int
    shares: dict[str, list[float]]  # expert shares on the held-out set, random router


@dataclass
class Comparison:
    """The fine-tuning runs per seed: held-out losses, verdicts, logs and speed."""

    seeds: list[int]
    losses: dict[str, list[float]]  # "moe", "dense": final held-out loss per seed
    equal_flops: list[float]  # the dense GPT-2 with the MoE's active parameters, per seed
    verdict: str
    flops_verdict: str
    logs: dict[str, list[list[dict]]]
    speed: dict[str, float]  # median tokens/s: "moe", "dense", "equal-flops"
    wide_total: int
    load_before: float
    load_after: float


@dataclass
class Generation:
    prompt: str
    text: str
    same: bool  # identical to Transformers' beam search


@dataclass
class Merged:
    model_class: str
    loss: float
    moe_loss: float  # the MoE it came from


@dataclass
class DemoResults:
    data: Data
    pretrained: Pretrained
    upcycled: Upcycled
    comparison: Comparison
    tuned_shares: dict[str, list[float]]  # expert shares after fine-tuning (the first seed's MoE)
    generation: Generation
    merged: Merged


def millions(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def moe_layers(args) -> str:
    """Which FFNs are MoE layers, in words."""
    return "every FFN" if args.moe_layer_frequency == 1 else f"one FFN in {args.moe_layer_frequency}"


def _spread(shares: dict[str, list[float]]) -> tuple[float, float]:
    return min(min(r) for r in shares.values()), max(max(r) for r in shares.values())


def _rows(seeds: list[int], moe: list[float], other: list[float]) -> str:
    return "\n".join(f"| {seed} | {m:.4f} | {d:.4f} | {m - d:+.4f} |" for seed, m, d in zip(seeds, moe, other, strict=True))


def report_markdown(args, r: DemoResults, clock: Clock, minutes: float) -> str:
    """The report: data, models, both comparisons, expert shares, generation, merging and run time."""
    d, u, c, g, m = r.data, r.upcycled, r.comparison, r.generation, r.merged
    k, layers, wide, seeds = args.num_experts_per_tok, moe_layers(args), r.pretrained.wide, c.seeds
    gate = f"gate `topk` (each token goes to the {k} experts its router scores highest, their weights renormalized)"
    total_steps = args.dense_steps + args.finetune_steps
    stage_times = ", ".join(f"{name} {seconds / 60:.1f} min" for name, seconds in clock.stages.items())
    epochs = total_steps * args.batch_size * args.block_size / d.train_tokens
    perplexity = math.exp(c.losses["moe"][0])
    spread = {"init": _spread(u.shares), "tuned": _spread(r.tuned_shares)}
    quick = "\n*`--quick`: tiny models and a few steps, a check that every stage runs; the numbers are not a result.*\n"
    moe_row = (f"{millions(u.moe_total)} ({u.moe_total / u.dense_total:.2f}x) | "
               f"{millions(u.moe_active)} ({u.moe_active / u.dense_total:.2f}x)")
    exact = "equal up to float32 rounding" if u.gap < 1e-4 else "NOT equal: upcycling went wrong"
    if m.loss > m.moe_loss:
        merge_note = ("Averaging keeps what the experts share and loses what they learned apart "
                      f"({m.loss - m.moe_loss:.4f} nats here).")
    else:
        merge_note = "The merged model is no worse than the MoE here."
    return f"""# hf-ppmoe demo
{quick if args.quick else ""}
## Data

The Python language reference that ships with CPython (`pydoc_data.topics`, no download: {d.topics} topics,
{d.distinct} distinct texts). **Held-out set**: every {d.held_out_every}th distinct topic in alphabetical order, from the first:
{", ".join(f"`{n}`" for n in d.held_names)} ({len(d.held_texts)} topics, {d.held_out.numel():,} tokens in
{len(d.held_out)} blocks of {args.block_size}). No model trains on them, the tokenizer (byte-level BPE, {len(d.tokenizer)}
tokens) is fitted without them, and every loss below called "held-out" is the next-token cross-entropy (nats per
token, router losses excluded) on these blocks. The other {len(d.train_texts)} topics ({d.train_tokens:,} tokens) are the
training set; steps are {args.batch_size} sequences of {args.block_size} tokens.

## Models

| model | parameters | active per token |
|---|---|---|
| dense GPT-2, {args.num_layers} layers, hidden {args.hidden_size} | {millions(u.dense_total)} | {millions(u.dense_total)} |
| upcycled GPT-MoE, {args.num_experts} experts top-{k} in {layers} | {moe_row} |
| dense GPT-2, FFN {wide} wide (the MoE's active parameters) | {millions(c.wide_total)} | {millions(c.wide_total)} |

Upcycling copies the dense FFN into every expert and adds a router per MoE layer: {gate}. The router starts random
(`router_init="random"`, seed {args.seed}) and learns which experts to use during fine-tuning; while the experts are
identical copies whose weights sum to 1, the MoE computes the dense model's function whatever the router picks: max
|logit difference| between the fresh MoE and the dense model on {u.probe_blocks} held-out blocks = {u.gap:.2e} ({exact}).

## Equal FLOPs per token: the MoE against a dense model of its active parameters

The papers' comparison. A GPT-2 whose FFN is {wide} wide has the upcycled MoE's active parameters per token (router
aside: {millions(c.wide_total)} against {millions(u.moe_active)}); it trains from scratch for {total_steps} steps, as many
as the MoE saw in pre-training and fine-tuning, with each seed's data order. Per token both compute the same; over the
run the dense model computes more, since the MoE's first {args.dense_steps} steps were the small dense model's:

| seed | MoE held-out loss | dense (equal active parameters) held-out loss | MoE minus dense |
|---|---|---|---|
{_rows(seeds, c.losses["moe"], c.equal_flops)}

{c.flops_verdict} Speed (median step, CPU proxy): MoE {c.speed['moe']:,.0f} tokens/s, dense with the MoE's active
parameters {c.speed['equal-flops']:,.0f} tokens/s.

## Dense pre-training, then fine-tuning both models

The dense model trains {args.dense_steps} steps (held-out loss {r.pretrained.eval_loss:.4f}). From there, the upcycled MoE and the
dense model each train {args.finetune_steps} more steps with the same schedule on the same batches, once per
data-order seed:

| seed | MoE held-out loss | dense held-out loss | MoE minus dense |
|---|---|---|---|
{_rows(seeds, c.losses["moe"], c.losses["dense"])}

{c.verdict}

Speed (median step of the fine-tuning runs above, the two models' runs interleaved on this machine, {os.cpu_count()}
cores, 1-min load average {c.load_before:.1f} before and {c.load_after:.1f} after them): MoE {c.speed['moe']:,.0f} tokens/s,
dense {c.speed['dense']:,.0f} tokens/s ({c.speed['moe'] / c.speed['dense']:.2f}x). The
comparison is at equal steps and equal data, not at equal compute: the MoE computes with
{u.moe_active / u.dense_total:.2f}x the dense model's active parameters per token.

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

Flat beam search ({args.num_beams} beams, GShard appendix A.5) with the seed-{seeds[0]} MoE from "{g.prompt}":

> {g.text!r}

Identical to Transformers' beam search: {g.same}. Why it reads as it does: the model has {millions(u.moe_total)}
parameters, has seen the training set {epochs:.2g} times ({total_steps} steps), and its
held-out perplexity is {perplexity:.0f} (exp of {c.losses['moe'][0]:.4f}): on average it is as unsure of the next token
as a uniform choice among {perplexity:.0f}. That is enough to pick up frequent words, markup and code fragments of the
corpus, not to follow a thought, and beam search, which returns the most probable continuation, tends to favour generic
and repeated phrases; no_repeat_ngram_size=3 (no three tokens twice) keeps it from looping.

## Merging back into GPT-2

The seed-{seeds[0]} MoE's experts merged into a plain `{m.model_class}` (router-usage-weighted mean), the
dense model's size again: held-out loss {m.loss:.4f}, against {m.moe_loss:.4f} for the MoE it came from and
{c.losses['dense'][0]:.4f} for the dense model fine-tuned on the same batches. {merge_note}

## Run time

{minutes:.1f} minutes in all on {os.cpu_count()} cores (1-min load average {clock.load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at
the end): {stage_times}.

Folders: `data/` (training and held-out topics), `dense/` (GPT-2), `moe-init/` (upcycled),
`finetune/moe-seedN/` and `finetune/dense-seedN/`, `equal-flops/dense-seedN/` (each with `logs/metrics.jsonl`), `merged/` (plain GPT-2, loads
without hf_ppmoe).
"""
