"""`hf-ppmoe demo`: the main job of the README, end to end on the built-in corpus (no download), in named steps
(`run_demo` calls them in this order; each returns a small dataclass of `demo_report.py`, which writes the report):

1. `prepare_data`, `pretrain_dense`: split the Python language reference that ships with CPython into training topics
   and a named held-out set, fit a tokenizer, and train a small dense GPT-2 on the training topics;
2. `upcycle_and_check`: upcycle it to a GPT-MoE and check that its logits equal the dense model's; count total and
   active parameters;
3. `finetune_and_compare`: fine-tune the MoE and, for the same steps on the same batches, the dense model, for several
   data-order seeds; compare their held-out loss per seed (the claim is made only if every seed agrees) and their
   tokens/s; and, the papers' comparison, against a dense GPT-2 with the MoE's active parameters (equal FLOPs per
   token) trained from scratch for as many steps as the MoE saw in all;
4. `measure_expert_shares`: the share of routes each expert receives in each MoE layer on the held-out set, before
   and after;
5. `generate_text`: generate with GShard flat beam search (and check it equals Transformers' beam search);
6. `merge_back`: merge the MoE's experts back into a plain GPT-2 and evaluate it on the same held-out set;
7. `write_report`: write a report (markdown + PNG plots) and print where it is.
Every stage is the library's public API: `hf_ppmoe.training.main`, `upcycle`, `flat_beam_search`, `merge_experts`.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GPT2Config

from ..conversion import merge_experts, upcycle
from ..generation import flat_beam_search
from ..modeling.loss import lm_loss_of
from ..moe.layer import MoELayer
from .data import builtin_corpus, pack, train_tokenizer
from .demo_arguments import DemoArguments
from .demo_report import (
    Comparison, Data, DemoResults, Generation, Merged, Pretrained, Upcycled, millions, moe_layers, report_markdown,
)
from .demo_runs import Clock, data_order_seeds, median_tokens_per_second, records, train_run, write_jsonl
from .tracking import plot_expert_share, plot_paired_runs

PROMPT = "The while statement"
HELD_OUT_EVERY = 10  # every 10th topic of the language reference (alphabetical order, from the first) is held out

QUICK = dict(dense_steps=4, finetune_steps=4, seeds=2, batch_size=16, block_size=32, hidden_size=32, num_layers=2,
             num_experts=4, num_beams=2, evaluations=2, eval_pairs=4)


def _train(args: DemoArguments, root: Path, out: str, steps: int, seed: int, logging_steps: int, **model) -> float:
    """A GPT-2 (or GPT-MoE) run on the demo's blocks; its final held-out loss."""
    return train_run(args, root, out, steps, seed, logging_steps, block_size=args.block_size, **model)["eval/loss"]


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


def prepare_data(args: DemoArguments, root: Path) -> Data:
    """Split the built-in corpus into training and held-out topics (root/data/), fit the tokenizer on the training
    topics (root/tokenizer/) and pack both into blocks."""
    corpus = builtin_corpus()
    train_texts, held_texts, held_names, distinct = _held_out(corpus)
    write_jsonl(root / "data" / "train.jsonl", [{"text": t} for t in train_texts])
    write_jsonl(root / "data" / "held-out.jsonl", [{"text": t} for t in held_texts])
    tokenizer = train_tokenizer(train_texts)
    tokenizer.save_pretrained(root / "tokenizer")
    held_out = pack(held_texts, tokenizer, args.block_size)
    return Data(len(corpus), distinct, HELD_OUT_EVERY, train_texts, held_texts, held_names, tokenizer, held_out,
                train_tokens=pack(train_texts, tokenizer, args.block_size).numel())


def pretrain_dense(args: DemoArguments, root: Path, data: Data) -> Pretrained:
    """Write the configs of the dense GPT-2 and of a GPT-2 with the MoE's active parameters; pre-train the first."""
    print(f"[1/7] dense GPT-2 pre-training ({args.dense_steps} steps)")
    tokenizer = data.tokenizer
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
    loss = _train(args, root, "dense", args.dense_steps, args.seed, max(1, args.dense_steps // 50),
                  config_name=str(root / "dense_config.json"))
    return Pretrained(loss, wide)


def upcycle_and_check(args: DemoArguments, root: Path, data: Data) -> Upcycled:
    """Upcycle the dense model to a GPT-MoE (root/moe-init/), check that its logits are the dense model's, count the
    parameters and measure the random router's expert shares."""
    k = args.num_experts_per_tok
    print(f"[2/7] upcycling to a GPT-MoE: {args.num_experts} experts, top-{k}, {moe_layers(args)}; the router starts random")
    dense = AutoModelForCausalLM.from_pretrained(root / "dense").eval()
    upcycle(root / "dense", num_experts=args.num_experts, num_experts_per_tok=k, router_type="topk",  # the report's gate
            router_init="random", moe_layer_frequency=args.moe_layer_frequency, seed=args.seed,
            save_directory=root / "moe-init", overwrite=True)
    moe = AutoModelForCausalLM.from_pretrained(root / "moe-init").eval()
    probe = data.held_out[: args.batch_size]
    with torch.no_grad():
        gap = (moe(probe).logits - dense(probe).logits).abs().max().item()
    u = Upcycled(gap, len(probe), dense.num_parameters(), moe.num_parameters(), moe.num_active_parameters(),
                 expert_shares(moe, data.held_out, args.batch_size))
    print(f"      max |logit difference| between the upcycled MoE and the dense model: {gap:.2e}")
    print(f"      parameters: dense {millions(u.dense_total)}; MoE {millions(u.moe_total)} total, "
          f"{millions(u.moe_active)} active per token")
    return u


def finetune_and_compare(args: DemoArguments, root: Path) -> Comparison:
    """Per seed, fine-tune the MoE and the dense model on the same batches, and train a dense GPT-2 with the MoE's
    active parameters from scratch for as many steps as the MoE saw in all; compare held-out losses and speed."""
    seeds = data_order_seeds(args)
    print(f"[3/7] fine-tuning the MoE and the dense model, {args.finetune_steps} steps on the same batches, seeds {seeds}")
    load_before = os.getloadavg()[0]
    losses, equal_flops = {"moe": [], "dense": []}, []
    total_steps = args.dense_steps + args.finetune_steps
    for seed in seeds:  # interleaved, so that a change in the machine's load hits every model alike
        losses["moe"].append(_train(args, root, f"finetune/moe-seed{seed}", args.finetune_steps, seed, 1,
                                    model_name_or_path=str(root / "moe-init")))
        losses["dense"].append(_train(args, root, f"finetune/dense-seed{seed}", args.finetune_steps, seed, 1,
                                      model_name_or_path=str(root / "dense")))
        equal_flops.append(_train(args, root, f"equal-flops/dense-seed{seed}", total_steps, seed, 1,
                                  config_name=str(root / "dense_active_config.json")))
        print(f"      seed {seed}: held-out loss MoE {losses['moe'][-1]:.4f}, dense {losses['dense'][-1]:.4f}, dense "
              f"with the MoE's active parameters (from scratch, {total_steps} steps) {equal_flops[-1]:.4f}")
    verdict = _verdict([m - d for m, d in zip(losses["moe"], losses["dense"])])
    print(f"      {verdict}")
    logs = {name: [records(root, f"finetune/{name}-seed{seed}") for seed in seeds] for name in losses}
    speed = {name: median_tokens_per_second(runs) for name, runs in logs.items()}
    speed["equal-flops"] = median_tokens_per_second([records(root, f"equal-flops/dense-seed{seed}") for seed in seeds])
    flops_verdict = _verdict([m - d for m, d in zip(losses["moe"], equal_flops)])
    wide_total = AutoModelForCausalLM.from_pretrained(root / f"equal-flops/dense-seed{seeds[0]}").num_parameters()
    print(f"      against the dense model with the MoE's active parameters: {flops_verdict}")
    return Comparison(seeds, losses, equal_flops, verdict, flops_verdict, logs, speed, wide_total, load_before,
                      load_after=os.getloadavg()[0])


def measure_expert_shares(args: DemoArguments, root: Path, data: Data, comparison: Comparison):
    """The first seed's fine-tuned MoE, and the share of routes each of its experts receives on the held-out set."""
    print("[4/7] expert token shares on the held-out set")
    moe = AutoModelForCausalLM.from_pretrained(root / f"finetune/moe-seed{comparison.seeds[0]}").eval()
    return moe, expert_shares(moe, data.held_out, args.batch_size)


def generate_text(args: DemoArguments, data: Data, moe) -> Generation:
    """Continue PROMPT with flat beam search, and check that Transformers' beam search returns the same tokens."""
    print(f"[5/7] generating with flat beam search ({args.num_beams} beams)")
    tokenizer = data.tokenizer
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    new_tokens = min(30, args.block_size - prompt.shape[1])  # the model has block_size positions
    # no 3 tokens twice: the continuation cannot loop (a penalty on repeated tokens alone let it emit 29 newlines)
    kw = dict(num_beams=args.num_beams, max_new_tokens=new_tokens, no_repeat_ngram_size=3, min_new_tokens=new_tokens,
              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    flat = moe.generate(prompt, custom_generate=flat_beam_search, **kw)
    same = torch.equal(flat, moe.generate(prompt, **kw))
    text = tokenizer.decode(flat[0], skip_special_tokens=True)
    print(f"      {text!r}\n      identical to Transformers' beam search: {same}")
    return Generation(PROMPT, text, same)


def merge_back(args: DemoArguments, root: Path, data: Data, comparison: Comparison, moe) -> Merged:
    """Merge the first seed's MoE into a plain GPT-2 (root/merged/); the held-out loss of both."""
    print("[6/7] merging the experts back into a plain GPT-2 (router-usage-weighted mean)")
    path = merge_experts(root / f"finetune/moe-seed{comparison.seeds[0]}", method="usage",
                         sample_texts=data.train_texts[:20], tokenizer=data.tokenizer, save_directory=root / "merged",
                         overwrite=True)
    merged = AutoModelForCausalLM.from_pretrained(path).eval()
    result = Merged(type(merged).__name__, _lm_loss(merged, data.held_out, args.batch_size),
                    _lm_loss(moe, data.held_out, args.batch_size))
    print(f"      {result.model_class}: held-out loss {result.loss:.4f} (the MoE it came from: {result.moe_loss:.4f})")
    return result


def write_report(args: DemoArguments, root: Path, results: DemoResults, clock: Clock) -> Path:
    """Plot the runs and the expert shares, write root/report.md and print where it is."""
    print("[7/7] writing the report")
    logs, first = results.comparison.logs, results.comparison.seeds[0]
    plot_paired_runs({"MoE": logs["moe"], "dense": logs["dense"]}, root / "training.png", records(root, "dense"))
    before = f"upcycled, before fine-tuning ({args.num_experts} experts, top-{args.num_experts_per_tok})"
    after = f"after {args.finetune_steps} fine-tuning steps (seed {first})"
    plot_expert_share({before: results.upcycled.shares, after: results.tuned_shares}, root / "expert_share.png")
    minutes = clock.minutes()
    (root / "report.md").write_text(report_markdown(args, results, clock, minutes))
    print(f"done in {minutes:.1f} min: report at {(root / 'report.md').resolve()} (plots: training.png, expert_share.png)")
    return root / "report.md"


def run_demo(args: DemoArguments) -> Path:
    """Run the demo's steps (the seq2seq demo with --seq2seq); returns the report's path."""
    if args.quick:
        args = dataclasses.replace(args, **QUICK)
    if args.seq2seq:
        from .demo_seq2seq import run_seq2seq_demo

        return run_seq2seq_demo(args)
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    torch.manual_seed(args.seed)
    data = prepare_data(args, root)
    with clock.stage("dense pre-training"):
        pretrained = pretrain_dense(args, root, data)
    with clock.stage("upcycling"):
        upcycled = upcycle_and_check(args, root, data)
    with clock.stage("fine-tuning"):
        comparison = finetune_and_compare(args, root)
    with clock.stage("expert shares, generation, merging"):
        moe, tuned_shares = measure_expert_shares(args, root, data, comparison)
        generation = generate_text(args, data, moe)
        merged = merge_back(args, root, data, comparison, moe)
    results = DemoResults(data, pretrained, upcycled, comparison, tuned_shares, generation, merged)
    return write_report(args, root, results, clock)
