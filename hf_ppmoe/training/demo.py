"""`hf-ppmoe demo`: the README's main job, end to end on the built-in corpus (no download).

1. train a small dense GPT-2 on the Python language reference that ships with CPython;
2. upcycle it to a GPT-MoE and check that its logits equal the dense model's;
3. fine-tune the MoE and, for the same steps on the same batches, the dense model; compare their eval loss;
4. generate with GShard flat beam search (and check it equals Transformers' beam search);
5. merge the MoE's experts back into a plain GPT-2;
6. write a report (markdown + PNG plots) and print where it is.
Every stage is the library's public API: `hf_ppmoe.training.main`, `upcycle`, `flat_beam_search`, `merge_experts`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config

from ..conversion import merge_experts, upcycle
from ..generation import flat_beam_search
from .arguments import TrainArguments
from .data import builtin_corpus, train_tokenizer
from .tracking import curve, plot_expert_load, read_jsonl
from .train import main as train

PROMPT = "The assert statement"


@dataclass
class DemoArguments:
    output_dir: str = field(default="hf-ppmoe-demo", metadata={"help": "Where models, logs, plots and the report go."})
    dense_steps: int = field(default=150, metadata={"help": "Steps of dense pre-training."})
    finetune_steps: int = field(default=100, metadata={"help": "Steps of MoE (and dense) fine-tuning."})
    batch_size: int = field(default=16, metadata={"help": "Sequences per step."})
    block_size: int = field(default=128, metadata={"help": "Tokens per sequence."})
    hidden_size: int = field(default=128, metadata={"help": "Model width."})
    num_layers: int = field(default=4, metadata={"help": "Transformer layers (every other FFN becomes MoE)."})
    num_experts: int = field(default=8, metadata={"help": "Experts per MoE layer."})
    num_beams: int = field(default=4, metadata={"help": "Beams for flat beam search."})
    learning_rate: float = field(default=2e-3, metadata={"help": "Peak learning rate of every stage."})
    seed: int = field(default=0, metadata={"help": "Random seed."})


def _train(args: DemoArguments, out: Path, steps: int, seed: int, **model) -> dict:
    return train(
        TrainArguments(
            output_dir=str(out), tokenizer_name=str(Path(args.output_dir) / "tokenizer"), max_steps=steps,
            per_device_train_batch_size=args.batch_size, block_size=args.block_size, learning_rate=args.learning_rate,
            warmup_steps=max(1, steps // 10), eval_steps=max(1, steps // 4), eval_batches=0, seed=seed,
            logging_steps=max(1, steps // 50), plots=False, **model,
        )
    )


@torch.no_grad()
def _lm_loss(model, blocks: torch.Tensor) -> float:
    """Next-token cross-entropy alone (an MoE's `loss` also carries its router losses)."""
    logits = model(blocks).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), blocks[:, 1:].flatten()).item()


def _curve(run: Path, key: str):
    return curve(read_jsonl(run / "logs" / "metrics.jsonl"), key)


def _plots(root: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    dense_steps = _curve(root / "dense", "train/lm_loss")[0][-1]
    ax.plot(*_curve(root / "dense", "train/lm_loss"), color="gray", label="dense pre-training")
    for run, color, label in (("dense-finetuned", "tab:blue", "dense, continued"), ("moe", "tab:red", "upcycled MoE")):
        steps, values = _curve(root / run, "train/lm_loss")
        ax.plot([dense_steps + s for s in steps], values, color=color, label=f"{label} (train)")
        steps, values = _curve(root / run, "eval/loss")
        ax.plot([dense_steps + s for s in steps], values, color=color, marker="o", linestyle="--", label=f"{label} (eval)")
    ax.axvline(dense_steps, color="black", linewidth=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("LM cross-entropy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(root / "loss.png", dpi=120)
    plt.close(fig)

    plot_expert_load(read_jsonl(root / "moe" / "logs" / "metrics.jsonl"), root / "expert_load.png", "fine-tuning step")
    return ["loss.png", "expert_load.png"]


def run_demo(args: DemoArguments) -> Path:
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    texts = builtin_corpus()
    tokenizer = train_tokenizer(texts)
    tokenizer.save_pretrained(root / "tokenizer")

    print(f"[1/6] dense GPT-2 pre-training ({args.dense_steps} steps)")
    GPT2Config(
        vocab_size=len(tokenizer), n_embd=args.hidden_size, n_layer=args.num_layers, n_head=max(1, args.hidden_size // 32),
        n_positions=args.block_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ).to_json_file(root / "dense_config.json")
    dense_eval = _train(args, root / "dense", args.dense_steps, args.seed, config_name=str(root / "dense_config.json"))

    print(f"[2/6] upcycling to a GPT-MoE: {args.num_experts} experts, top-2, every other FFN")
    dense = AutoModelForCausalLM.from_pretrained(root / "dense").eval()
    upcycle(root / "dense", num_experts=args.num_experts, num_experts_per_tok=2, router_type="topk",
            router_init="random", seed=args.seed, save_directory=root / "moe-init", overwrite=True)
    moe = AutoModelForCausalLM.from_pretrained(root / "moe-init").eval()
    sample = tokenizer(texts[0][:400], return_tensors="pt").input_ids[:, : args.block_size]
    with torch.no_grad():
        gap = (moe(sample).logits - dense(sample).logits).abs().max().item()
    print(f"      max |logit difference| between the upcycled MoE and the dense model: {gap:.2e}")

    print(f"[3/6] fine-tuning the MoE and the dense model for {args.finetune_steps} steps on the same batches")
    moe_eval = _train(args, root / "moe", args.finetune_steps, args.seed + 1, model_name_or_path=str(root / "moe-init"))
    dense_ft_eval = _train(args, root / "dense-finetuned", args.finetune_steps, args.seed + 1, model_name_or_path=str(root / "dense"))
    better = moe_eval["eval/loss"] < dense_ft_eval["eval/loss"]
    print(f"      eval loss: upcycled MoE {moe_eval['eval/loss']:.4f} vs dense {dense_ft_eval['eval/loss']:.4f} "
          f"({'the MoE is lower' if better else 'the MoE is NOT lower this time'})")

    print(f"[4/6] generating with flat beam search ({args.num_beams} beams)")
    moe = AutoModelForCausalLM.from_pretrained(root / "moe").eval()
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    new_tokens = min(30, args.block_size - prompt.shape[1])  # the model has block_size positions
    kw = dict(num_beams=args.num_beams, max_new_tokens=new_tokens, repetition_penalty=1.3,
              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    flat = moe.generate(prompt, custom_generate=flat_beam_search, **kw)
    same = torch.equal(flat, moe.generate(prompt, **kw))
    text = tokenizer.decode(flat[0], skip_special_tokens=True)
    print(f"      {text!r}\n      identical to Transformers' beam search: {same}")

    print("[5/6] merging the experts back into a plain GPT-2 (router-usage-weighted mean)")
    merged = merge_experts(root / "moe", method="usage", sample_texts=texts[:20], tokenizer=tokenizer,
                           save_directory=root / "merged", overwrite=True)
    merged = AutoModelForCausalLM.from_pretrained(merged).eval()
    blocks = tokenizer("\n\n".join(texts[-3:]), return_tensors="pt").input_ids
    blocks = blocks[:, : (blocks.shape[1] // args.block_size) * args.block_size].view(-1, args.block_size)[:16]
    merged_loss, moe_loss = _lm_loss(merged, blocks), _lm_loss(moe, blocks)
    print(f"      {type(merged).__name__}: loss {merged_loss:.4f} on held-out text (the MoE: {moe_loss:.4f})")

    print("[6/6] writing the report")
    plots = _plots(root)
    minutes = (time.perf_counter() - start) / 60
    report = f"""# hf-ppmoe demo

Built-in corpus: the Python language reference shipped with CPython ({len(texts)} documents); byte-level BPE
tokenizer with {len(tokenizer)} tokens; sequences of {args.block_size} tokens, {args.batch_size} per step.

| stage | model | steps | eval loss |
|---|---|---|---|
| dense pre-training | GPT-2, {args.num_layers} layers, hidden {args.hidden_size} | {args.dense_steps} | {dense_eval['eval/loss']:.4f} |
| fine-tuning | dense GPT-2, continued | {args.finetune_steps} | {dense_ft_eval['eval/loss']:.4f} |
| fine-tuning | upcycled GPT-MoE, {args.num_experts} experts top-2, every other FFN | {args.finetune_steps} | {moe_eval['eval/loss']:.4f} |

- Upcycling is exact: max |logit difference| between the fresh MoE and the dense model = {gap:.2e}.
- After the same fine-tuning steps on the same batches the MoE's eval loss is {'lower' if better else 'not lower'} than the
  dense model's ({moe_eval['eval/loss']:.4f} vs {dense_ft_eval['eval/loss']:.4f}).
- Flat beam search ({args.num_beams} beams) from "{PROMPT}": `{text!r}`; identical to Transformers' beam search: {same}.
- Merged back into `{type(merged).__name__}` (router-usage-weighted mean of the experts): held-out loss
  {merged_loss:.4f}, against {moe_loss:.4f} for the MoE.
- Total time: {minutes:.1f} minutes.

![loss](loss.png)

![expert load](expert_load.png)

Folders: `dense/` (GPT-2), `moe-init/` (upcycled), `moe/` (fine-tuned GPT-MoE), `dense-finetuned/`, `merged/`
(plain GPT-2, loads without hf_ppmoe); each run has `logs/metrics.jsonl`.
"""
    (root / "report.md").write_text(report)
    print(f"done in {minutes:.1f} min: report at {(root / 'report.md').resolve()} (plots: {', '.join(plots)})")
    return root / "report.md"
