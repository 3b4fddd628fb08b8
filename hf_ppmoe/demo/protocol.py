"""The experiment both `hf-ppmoe demo` and `benchmarks/quality.py` run: its settings, corpus, models, FLOP count and
training loop, in one place.

Corpus (no download): the .py files of the CPython standard library this interpreter ships (code, comments and
docstrings; test suites included; site-packages excluded), split into train / held-out BY FILE (every 20th file in
the order of the SHA-1 of its relative path is held out), tokenized with a byte-level BPE fitted on the train files
only. Documents are joined with an end-of-text token; training batches are random windows of the train stream, the
same windows for every arm of a seed (each run records a hash of its batches); the held-out set is a fixed set of
evenly spaced windows of the held-out stream.

Models are GPT-MoE in the Llama layout (rotary, RMSNorm, SwiGLU); every arm of a seed is built under the same torch
seed. Training: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warmup then cosine decay to 10% of the
peak, gradient clipping at 1.0, the model's own loss (LM + router aux 0.01 + z-loss 0.001). The reported held-out
loss is the LM cross-entropy alone. FLOPs are counted analytically (`flops_per_token`): training = 3 x forward.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import sysconfig
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

from ..conversion import upcycle
from ..modeling import GPTMoEConfig, GPTMoEForCausalLM
from ..modeling.loss import lm_loss_of
from ..moe import LoadBalancer, MoELayer
from ..training.data import train_tokenizer
from ..training.tracking import RouterMonitor

HELD_OUT_EVERY = 20  # every 20th file (in SHA-1 order of the relative path) is held out: 5%


@dataclasses.dataclass(frozen=True)
class Setting:
    hidden: int
    layers: int
    heads: int
    block: int  # tokens per sequence
    batch: int  # sequences per step
    vocab: int
    steps: int
    upcycle_steps: int
    evals: int  # held-out evaluations after step 0
    eval_blocks: int  # held-out windows of `block` tokens
    lr: float
    warmup: int
    seeds: int
    device: str = "cpu"
    bf16: bool = False
    max_files: int | None = None  # the first N stdlib files in path order (smoke runs only)
    arms: tuple[str, ...] | None = None  # None: every arm of the experiment

    def compatible(self) -> dict:
        """The fields a cached run must share with this setting (more seeds or arms may be added later)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("seeds", "arms")}


# The reduced setting of benchmarks/quality.py, fixed 2026-11-24 before the demo ran this protocol; the demo's
# default. ~1M training tokens per run (500 steps x 16 x 128), hidden 64, 4 layers, MoE on every other layer.
CPU = Setting(hidden=64, layers=4, heads=2, block=128, batch=16, vocab=2048, steps=500, upcycle_steps=250,
              evals=10, eval_blocks=160, lr=3e-3, warmup=30, seeds=3)
# `--quick`: tiny models on 30 files, a few steps: every stage runs in seconds (a check, not a result)
QUICK = Setting(hidden=32, layers=2, heads=2, block=32, batch=4, vocab=320, steps=4, upcycle_steps=2, evals=2,
                eval_blocks=4, lr=1e-3, warmup=1, seeds=2, max_files=30)
# the demo trains on the train files in SHA-1 order up to this many bytes (~2.6M tokens: each run of CPU reads ~1M),
# so that fitting the tokenizer takes seconds; the held-out files are all of the split's
DEMO_TRAIN_BYTES = 8_000_000


# ------------------------------------------------------------------------------------------------------- corpus


def stdlib_files() -> tuple[Path, list[str]]:
    """The standard library folder and its .py files (relative paths, sorted), without site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        if Path(folder) == root:
            subfolders[:] = [d for d in subfolders if d != "site-packages"]  # installed packages, not the stdlib
        files += [(Path(folder) / n).relative_to(root).as_posix() for n in names if n.endswith(".py")]
    files.sort()
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library folder {root}; this Python ships no sources")
    return root, files


def split_files(files: list[str]) -> tuple[list[str], list[str]]:
    """(train, held-out) file lists: every HELD_OUT_EVERY-th file in the order of the SHA-1 of its path (stable under
    Python versions' added or removed files, and never empty)."""
    by_hash = sorted(files, key=lambda f: hashlib.sha1(f.encode()).hexdigest())
    held_out = set(by_hash[::HELD_OUT_EVERY])
    return [f for f in files if f not in held_out], [f for f in files if f in held_out]


def corpus(work: Path, vocab: int, max_files: int | None = None, train_bytes: int | None = None) -> dict:
    """Tokenizer and token streams, cached in `work`: {"train", "val": int32 tensors, "tokenizer", "stats"}.
    `train_bytes`: train on the train files in SHA-1 order up to that many bytes (the held-out files are the same)."""
    root, files = stdlib_files()
    files = files[:max_files]
    key = hashlib.sha1(json.dumps([files, vocab, platform.python_version(), train_bytes]).encode()).hexdigest()[:12]
    folder = work / f"corpus-{key}"
    if not (folder / "stats.json").exists():
        train_files, val_files = split_files(files)
        if train_bytes is not None:
            kept, size = [], 0
            for f in sorted(train_files, key=lambda f: hashlib.sha1(f.encode()).hexdigest()):
                if size >= train_bytes:
                    break
                kept.append(f)
                size += (root / f).stat().st_size
            train_files = sorted(kept)
        read = lambda names: [(root / f).read_text(encoding="utf-8", errors="replace") for f in names]  # noqa: E731
        train_texts, val_texts = read(train_files), read(val_files)
        tokenizer = train_tokenizer(train_texts, vocab_size=vocab)
        eos = tokenizer.eos_token_id

        def encode(texts):
            encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
            return torch.tensor([i for e in encodings for i in [*e.ids, eos]], dtype=torch.int32)

        tokens = {"train": encode(train_texts), "val": encode(val_texts)}
        stats = {
            "stdlib": str(root), "python": platform.python_version(), "files": len(files),
            "train_files": train_files, "val_files": val_files,
            "train_bytes": sum(len(t.encode()) for t in train_texts), "val_bytes": sum(len(t.encode()) for t in val_texts),
            "train_tokens": len(tokens["train"]), "val_tokens": len(tokens["val"]), "vocab_size": len(tokenizer),
        }
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(folder / "tokenizer")
        torch.save(tokens, folder / "tokens.pt")
        (folder / "stats.json").write_text(json.dumps(stats, indent=1))  # last: marks the cache complete
    stats = json.loads((folder / "stats.json").read_text())
    tokens = torch.load(folder / "tokens.pt")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")
    return {**tokens, "tokenizer": tokenizer, "stats": stats, "folder": folder}


# ------------------------------------------------------------------------------------------------------- models


def base_config(s: Setting, tokenizer) -> dict:
    """The GPT-MoE fields every arm shares: the dense model's FFN is F = 4 x hidden."""
    return dict(
        vocab_size=len(tokenizer), hidden_size=s.hidden, intermediate_size=4 * s.hidden, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, max_position_embeddings=s.block, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )


def moe(router_type: str, experts: int, k: int, **extra):
    """GPT-MoE fields as a function of the dense FFN size F: `experts` experts of F / k, top-k (the dense model's
    active FFN FLOPs per token)."""
    return lambda F: dict(router_type=router_type, num_experts=experts, num_experts_per_tok=k,
                          moe_intermediate_size=F // k, **extra)


def dense(F: int) -> dict:
    """GPT-MoE fields of the dense model: no MoE layer."""
    return dict(moe_layers=[])


def build(s: Setting, tokenizer, fields, seed: int) -> GPTMoEForCausalLM:
    """A GPT-MoE of the setting with the arm's `fields` (a function of F, as `moe` and `dense` return), built under
    `seed`: every arm of a seed starts from the same torch seed."""
    torch.manual_seed(seed)
    return GPTMoEForCausalLM(GPTMoEConfig(**base_config(s, tokenizer), **fields(4 * s.hidden)))


# The demo's arms. From scratch at equal FLOPs per token and equal tokens: the dense model, and the MoE with the
# library's default gate (`GPTMoEConfig.router_type`: "topk", dropless, PPMoE's default) with k = 2 routes to experts
# of F/2 among 16 (quality.py's `top2` arm: the dense model's active FFN FLOPs, 8x its FFN parameters).
# Upcycling, from each seed's final dense model, equal tokens: continued dense, and upcycled (`UPCYCLE`).
# Optional parameter bound: a dense FFN as wide as all the experts together (quality.py's `dense_wide`).
SCRATCH_ARMS = {
    "dense_scratch": ("dense, FFN F = 4 x hidden", dense),
    "moe_scratch": (f"MoE, gate `{GPTMoEConfig.router_type}` top-2 of 16 experts of F/2", moe(GPTMoEConfig.router_type, 16, 2)),
    "dense_wide": ("dense, FFN 8F in the MoE layers' places (the MoE's parameters)", lambda F: dict(
        router_type="topk", num_experts=1, num_experts_per_tok=1, moe_intermediate_size=8 * F,
        router_aux_loss_coef=0.0, router_z_loss_coef=0.0)),
}
UPCYCLE_ARMS = {
    "dense_continued": "the seed's dense_scratch model, trained on as dense",
    "moe_upcycled": "the seed's dense_scratch model upcycled: top-2 of 8 copies of its FFN, random router",
}
UPCYCLE = dict(num_experts=8, num_experts_per_tok=2, router_type="topk", router_init="random")


def as_llama(model: GPTMoEForCausalLM) -> LlamaForCausalLM:
    """A dense GPT-MoE (Llama layout, no MoE layer) as the Transformers Llama model it equals (same weight names)."""
    c = model.config
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.layer_norm_eps, hidden_act=c.hidden_act, tie_word_embeddings=False,
        pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
    ))
    llama.load_state_dict(model.state_dict())
    return llama


def upcycle_from(dense_model: GPTMoEForCausalLM, seed: int, check: torch.Tensor) -> tuple[GPTMoEForCausalLM, float]:
    """The dense GPT-MoE as a Llama model, upcycled by hf_ppmoe.conversion (`UPCYCLE`: 8 copies of the dense FFN,
    top-2, a random router); returns the MoE and the largest logit difference to the dense model on `check`."""
    llama = as_llama(dense_model)
    moe_model = upcycle(llama, seed=seed, **UPCYCLE)
    with torch.no_grad():
        models = [m.eval() for m in (dense_model, llama, moe_model)]
        reference, *others = [m(check).logits for m in models]
        gap = max((o - reference).abs().max().item() for o in others)
    dense_model.train()
    return moe_model.train(), gap


def flops_per_token(config, block: int) -> dict:
    """Analytic FLOPs per token of a GPT-MoE (2 per multiply-add): projections, causal attention mixing (average
    context block / 2 for QK^T and for AV), FFNs (k routes of the experts' size in MoE layers), routers, LM head.
    Training counts 3 x forward (the backward pass is twice the forward)."""
    d, hd = config.hidden_size, config.head_dim or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    matrices = 3 if config.gated_mlp else 2
    attention = ffn = router = 0
    for i in range(config.num_hidden_layers):
        attention += 2 * d * (2 * q + 2 * kv) + 2 * block * q
        if config.is_moe_layer(i):
            inner = config.moe_intermediate_size or config.intermediate_size
            ffn += 2 * matrices * d * inner * config.num_experts_per_tok
            router += 2 * d * config.num_experts
        else:
            ffn += 2 * matrices * d * config.intermediate_size
    forward = attention + ffn + router + 2 * d * config.vocab_size
    return {"attention": attention, "ffn": ffn, "router": router, "forward": forward, "train": 3 * forward}


def parameters(model) -> dict:
    """Total parameters and those one token uses (an MoE layer's unused experts excluded)."""
    total = sum(p.numel() for p in model.parameters())
    unused = 0
    for module in model.modules():
        if isinstance(module, MoELayer):
            E, k = module.experts.num_experts, model.config.num_experts_per_tok
            unused += sum(p.numel() for p in module.experts.parameters()) * (E - k) // E
    return {"total": total, "active": total - unused}


# ----------------------------------------------------------------------------------------------------- training


def windows(stream: torch.Tensor, starts: torch.Tensor, block: int) -> torch.Tensor:
    return stream[starts[:, None] + torch.arange(block)].long()


def held_out_blocks(data: dict, s: Setting) -> torch.Tensor:
    """The fixed held-out set: `eval_blocks` evenly spaced windows of the held-out stream."""
    val = data["val"]
    return windows(val, torch.linspace(0, len(val) - s.block - 1, s.eval_blocks).long(), s.block)


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, s: Setting) -> float:
    """Mean LM cross-entropy (next-token, router losses excluded) over the held-out windows."""
    model.eval()
    total = torch.zeros((), device=s.device, dtype=torch.float64)
    for x in blocks.split(s.batch):
        x = x.to(s.device)
        with torch.autocast(s.device, dtype=torch.bfloat16, enabled=s.bf16):
            quiet = {"compute_router_losses": False} if isinstance(model, GPTMoEForCausalLM) else {}  # no statistics
            lm_loss, count = lm_loss_of(model(x, labels=x, **quiet), x, causal=True)
        total += lm_loss.double() * count
    model.train()
    return (total / (blocks.shape[0] * (blocks.shape[1] - 1))).item()


def train(model, data: dict, s: Setting, steps: int, data_seed: int, label: str = "", verbose: bool = True) -> dict:
    """Train `model` for `steps` steps on random train windows drawn with `data_seed`; held-out loss every
    steps / evals steps (and at step 0), router statistics, timing and the SHA-1 of every batch in order
    (`verbose`: print each evaluation, prefixed with `label`)."""
    model.to(s.device).train()
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                                  lr=s.lr, betas=(0.9, 0.95))
    schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, s.warmup, steps, min_lr_rate=0.1)
    generator = torch.Generator().manual_seed(data_seed)
    val_blocks = held_out_blocks(data, s)
    config, monitor = model.config, RouterMonitor(model)
    LoadBalancer(model).step_with(optimizer)  # bias balancing / global-batch loss arms: after every optimizer step
    flops = flops_per_token(config, s.block)["train"]
    eval_at = {round(steps * i / s.evals) for i in range(s.evals + 1)}
    curve, train_loss, timed = [], torch.zeros((), device=s.device), {"steps": 0, "wall": 0.0, "cpu": 0.0}
    interval = [0, time.perf_counter(), time.process_time()]  # steps, wall, cpu at the last evaluation
    order = hashlib.sha1()
    for step in range(steps + 1):
        if step in eval_at:
            if s.device == "cuda":
                torch.cuda.synchronize()
            wall, cpu = time.perf_counter(), time.process_time()
            if interval[0] > 0:  # the first interval (allocator, kernel selection) is left out of the timing
                timed["steps"] += step - interval[0]
                timed["wall"] += wall - interval[1]
                timed["cpu"] += cpu - interval[2]
            router = monitor.collect()
            point = {"step": step, "tokens": step * s.batch * s.block, "flops": step * s.batch * s.block * flops,
                     "val_loss": evaluate(model, val_blocks, s),
                     "train_loss": (train_loss / (step - interval[0])).item() if step else None}
            if router:
                point["expert_load_cv"] = statistics.mean(v for k, v in router.items() if k.startswith("expert_load"))
                point["dropped"] = statistics.mean(v for k, v in router.items() if k.startswith("dropped"))
                point["load_max_over_mean"] = statistics.mean(v for k, v in router.items() if k.startswith("load_max"))
            if not math.isfinite(point["val_loss"]):
                raise RuntimeError(f"held-out loss is {point['val_loss']} at step {step}: the run diverged")
            curve.append(point)
            if verbose:
                print(f"{label:>20} step {step:5d}/{steps}: held-out loss {point['val_loss']:.4f}", flush=True)
            train_loss.zero_()
            interval = [step, time.perf_counter(), time.process_time()]
        if step == steps:
            break
        x = windows(data["train"], torch.randint(len(data["train"]) - s.block, (s.batch,), generator=generator), s.block)
        order.update(x.numpy().tobytes())
        x = x.to(s.device, non_blocking=True)
        with torch.autocast(s.device, dtype=torch.bfloat16, enabled=s.bf16):
            out = model(x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        train_loss += lm_loss_of(out, x, causal=True)[0].detach()
    monitor.remove()
    tokens = timed["steps"] * s.batch * s.block
    return {
        "val_loss": curve[-1]["val_loss"], "curve": curve, "flops_per_token": flops_per_token(config, s.block),
        "params": parameters(model), "train_tokens": steps * s.batch * s.block, "data_order": order.hexdigest(),
        "tokens_per_s": tokens / timed["wall"] if timed["wall"] else None,
        "tokens_per_cpu_s": tokens / timed["cpu"] if timed["cpu"] else None,
    }
