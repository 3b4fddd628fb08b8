"""`hf-ppmoe demo`: the README's main job, on the built-in corpus.

Builds a small GPT-MoE, trains it briefly on the Python language reference that ships with CPython, prints the
loss and how many tokens each expert received, generates text, and saves model + tokenizer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..modeling import GPTMoEConfig, GPTMoEForCausalLM
from ..moe import MoELayer
from .data import builtin_corpus, pack, train_tokenizer


@dataclass
class DemoArguments:
    output_dir: str = field(default="hf-ppmoe-demo", metadata={"help": "Where the trained model and tokenizer go."})
    steps: int = field(default=120, metadata={"help": "Training steps."})
    batch_size: int = field(default=16, metadata={"help": "Sequences per step."})
    block_size: int = field(default=128, metadata={"help": "Tokens per sequence."})
    hidden_size: int = field(default=128, metadata={"help": "Model width."})
    num_layers: int = field(default=4, metadata={"help": "Transformer layers (every other FFN is MoE)."})
    num_experts: int = field(default=8, metadata={"help": "Experts per MoE layer."})
    router_type: str = field(default="gshard", metadata={"help": "topk, switch, gshard, prototype, or your own."})
    learning_rate: float = field(default=3e-3, metadata={"help": "AdamW learning rate."})
    seed: int = field(default=0, metadata={"help": "Random seed."})


def expert_load_table(counts: dict[str, torch.Tensor]) -> str:
    rows = []
    for name, c in counts.items():
        share = c / c.sum().clamp(min=1)
        rows.append(f"  {name:<24}" + " ".join(f"{100 * s:5.1f}%" for s in share.tolist()))
    return "\n".join(rows)


def run_demo(args: DemoArguments) -> Path:
    torch.manual_seed(args.seed)
    texts = builtin_corpus()
    tokenizer = train_tokenizer(texts)
    blocks = pack(texts, tokenizer, args.block_size)
    n_eval = max(1, len(blocks) // 20)
    train, evaluation = blocks[:-n_eval], blocks[-n_eval:]
    print(f"built-in corpus: {len(texts)} documents, {blocks.numel():,} tokens, vocab {len(tokenizer)}")

    config = GPTMoEConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=max(1, args.hidden_size // 32),
        max_position_embeddings=args.block_size,
        num_experts=args.num_experts,
        num_experts_per_tok=2 if args.router_type in ("gshard", "topk", "prototype") else 1,
        router_type=args.router_type,
        capacity_factor=2.0 if args.router_type in ("gshard", "switch") else None,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model = GPTMoEForCausalLM(config)
    active = sum(p.numel() for n, p in model.named_parameters() if "experts" not in n)
    total = sum(p.numel() for p in model.parameters())
    print(f"GPT-MoE: {total / 1e6:.2f}M parameters ({config.num_experts} experts, {config.router_type} gate)")

    counts: dict[str, torch.Tensor] = {}

    def count_tokens(module, inputs, output, name):
        counts[name] = counts.get(name, 0) + output[1].tokens_per_expert

    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            module.register_forward_hook(lambda m, i, o, name=name.replace("model.", ""): count_tokens(m, i, o, name))

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.learning_rate, total_steps=args.steps, pct_start=0.1)
    model.train()
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc="training", dynamic_ncols=True)
    for step in bar:
        batch = train[torch.randint(0, len(train), (args.batch_size,))]
        out = model(batch, labels=batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{out.loss.item():.3f}", aux=f"{out.aux_loss.item():.3f}")
    elapsed = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        eval_loss = model(evaluation, labels=evaluation).loss.item()
    print(f"trained {args.steps} steps in {elapsed:.0f}s ({args.steps * train[:1].numel() * args.batch_size / elapsed:,.0f} tokens/s); "
          f"eval loss {eval_loss:.3f} (perplexity {torch.tensor(eval_loss).exp():.1f})")
    print("share of routed tokens per expert, per MoE layer:")
    print(expert_load_table(counts))

    prompt = "The assert statement"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    print(f"greedy continuation of {prompt!r}:\n  {tokenizer.decode(generated[0])!r}")

    out_dir = Path(args.output_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"saved model and tokenizer to {out_dir.resolve()} (load with AutoModelForCausalLM.from_pretrained)")
    return out_dir
