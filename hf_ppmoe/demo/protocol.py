"""The experiment both `hf-ppmoe demo` and `benchmarks/quality.py` run: its settings, corpus, models and FLOP count
(the training loop: `loop.py`). Revision 2 of the protocol, fixed by the rules of benchmarks/PROTOCOL.md before any
of its claim seeds ran.

Corpus (no download): the .py files of the CPython standard library this interpreter ships (code, comments and
docstrings; test suites included; site-packages excluded), split into train / held-out BY FILE (every 20th file in
the order of the SHA-1 of its relative path is held out), tokenized with a byte-level BPE fitted on the first 8 MB of
the train files (in SHA-1 order). Documents are joined with an end-of-text token; training batches are random
windows of the whole train stream, the same windows for every arm of a seed (each run records a chained hash of its
batches); the held-out sets are fixed sets of evenly spaced windows of the held-out stream.

Models are GPT-MoE in the Llama layout (rotary, RMSNorm, SwiGLU); every arm of a seed is built under the same torch
seed. Training: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), warmup-stable-decay (`loop.learning_rate`),
gradient clipping at 1.0, the model's own loss (LM + router aux 0.01 + z-loss 0.001). The reported held-out loss is
the LM cross-entropy alone. FLOPs are counted analytically (`flops_per_token`): training = 3 x forward.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sysconfig
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ..conversion import upcycle
from ..modeling import GPTMoEConfig, GPTMoEForCausalLM
from ..training.data import train_tokenizer
from .loop import Run, make_optimizer, windows

HELD_OUT_EVERY = 20  # every 20th file (in SHA-1 order of the relative path) is held out: 5%
TOKENIZER_BYTES = 8_000_000  # the BPE is fitted on the train files in SHA-1 order up to this many bytes (seconds)


@dataclasses.dataclass(frozen=True)
class Setting:
    hidden: int
    layers: int
    heads: int
    block: int  # tokens per sequence
    batch: int  # sequences per step
    vocab: int
    steps: int  # the budget: optimizer steps of the from-scratch arms (the upcycled arm starts at steps // 2)
    lr: float  # peak learning rate
    warmup: int  # warm-up steps
    eval_every: int  # steps between held-out evaluations on `eval_blocks` windows (the curve)
    eval_blocks: int  # held-out windows of `block` tokens of the curve's points
    final_blocks: int  # held-out windows of the final evaluation (the claims)
    seeds: int
    decay: float = 0.2  # the cool-down: the last 20% of the steps
    device: str = "cpu"
    bf16: bool = False
    max_files: int | None = None  # the first N stdlib files in path order (smoke runs only)
    arms: tuple[str, ...] | None = None  # None: every arm of the experiment

    def compatible(self) -> dict:
        """The fields a cached run must share with this setting (more seeds, arms or budgets may be added later)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("seeds", "arms", "steps")}

    def tokens(self, steps: int | None = None) -> int:
        """Training tokens of `steps` (default: the budget) steps."""
        return (self.steps if steps is None else steps) * self.batch * self.block


# Revision 2 (benchmarks/PROTOCOL.md): the demo's default and quality.py's `cpu` setting. lr and warmup: R5's
# tuning on validation seeds; steps: R6's budget; final_blocks: R7's measurement.
CPU = Setting(hidden=64, layers=4, heads=2, block=128, batch=16, vocab=2048, steps=1000, lr=4e-3, warmup=150,
              eval_every=50, eval_blocks=160, final_blocks=2560, seeds=3)
# `--quick`: tiny models on 30 files, a few steps: every stage runs in seconds (a check, not a result)
QUICK = Setting(hidden=32, layers=2, heads=2, block=32, batch=4, vocab=320, steps=8, lr=1e-3, warmup=1, eval_every=2,
                eval_blocks=4, final_blocks=6, seeds=2, max_files=30)


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


def corpus(work: Path, vocab: int, max_files: int | None = None) -> dict:
    """Tokenizer and token streams, cached in `work`: {"train", "val": int32 tensors, "tokenizer", "stats"}. The BPE
    is fitted on the train files in SHA-1 order up to TOKENIZER_BYTES; both streams hold every file of their split."""
    root, files = stdlib_files()
    files = files[:max_files]
    key = hashlib.sha1(json.dumps([files, vocab, platform.python_version(), TOKENIZER_BYTES]).encode()).hexdigest()[:12]
    folder = work / f"corpus-{key}"
    if not (folder / "stats.json").exists():
        train_files, val_files = split_files(files)
        fit_files, size = [], 0
        for f in sorted(train_files, key=lambda f: hashlib.sha1(f.encode()).hexdigest()):
            if size >= TOKENIZER_BYTES:
                break
            fit_files.append(f)
            size += (root / f).stat().st_size
        read = lambda names: [(root / f).read_text(encoding="utf-8", errors="replace") for f in names]  # noqa: E731
        train_texts, val_texts = read(train_files), read(val_files)
        tokenizer = train_tokenizer(read(sorted(fit_files)), vocab_size=vocab)
        eos = tokenizer.eos_token_id

        def encode(texts):  # 100 files at a time: the tokenizer's encodings of every file would take GBs
            ids = []
            for i in range(0, len(texts), 100):
                encodings = tokenizer.backend_tokenizer.encode_batch(texts[i : i + 100], add_special_tokens=False)
                ids += [torch.tensor([*e.ids, eos], dtype=torch.int32) for e in encodings]
            return torch.cat(ids)

        tokens = {"train": encode(train_texts), "val": encode(val_texts)}
        stats = {
            "stdlib": str(root), "python": platform.python_version(), "files": len(files),
            "train_files": train_files, "val_files": val_files, "tokenizer_files": len(fit_files),
            "train_bytes": sum(len(t.encode()) for t in train_texts), "val_bytes": sum(len(t.encode()) for t in val_texts),
            "train_tokens": len(tokens["train"]), "val_tokens": len(tokens["val"]), "vocab_size": len(tokenizer),
        }
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(folder / "tokenizer")
        torch.save(tokens, folder / "tokens.pt")
        (folder / "stats.json").write_text(json.dumps(stats, indent=1))  # last: marks the cache complete
    stats = json.loads((folder / "stats.json").read_text())
    tokens = torch.load(folder / "tokens.pt", weights_only=True)
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
    return GPTMoEForCausalLM(GPTMoEConfig(**{**base_config(s, tokenizer), **fields(4 * s.hidden)}))


# The demo's arms (benchmarks/PROTOCOL.md R3, R4). From scratch at equal FLOPs per token and equal tokens: the dense
# model, and the MoE with the library's default gate (`GPTMoEConfig.router_type`: "topk", dropless) in every FFN,
# k = 2 routes to 4 experts of F/2 (the dense model's active FFN FLOPs, twice its FFN parameters). Upcycling: the
# seed's dense run at half the budget, upcycled with its optimizer state (`UPCYCLE`, `upcycle_run`), trains the
# second half beside the dense run itself. Optional parameter bound: every FFN as wide as all the experts together.
SCRATCH_ARMS = {
    "dense": ("dense, FFN F = 4 x hidden", dense),
    "moe_scratch": (f"MoE in every FFN, gate `{GPTMoEConfig.router_type}` top-2 of 4 experts of F/2",
                    moe(GPTMoEConfig.router_type, 4, 2, moe_layer_frequency=1)),
    "dense_wide": ("dense, every FFN 2F wide (all the experts together: the MoE's parameters)",
                   lambda F: dict(moe_layers=[], intermediate_size=2 * F)),
}
UPCYCLED = ("moe_upcycled", "the seed's dense run at half the budget, upcycled (top-2 of 8 copies of every other FFN, "
            "random router, the optimizer state copied), trained the second half beside it")
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


def upcycle_run(run: Run, s: Setting, seed: int, check: torch.Tensor) -> tuple[Run, float]:
    """The dense `run` upcycled (`upcycle_from`) with its optimizer state (Komatsuzaki et al. 2022, Fig. 1): each
    weight's AdamW moments and step go where `upcycle` puts the weight (its moments are upcycled by the same map);
    the routers start without state. The data stream, step, batch chain and curve continue the dense run's (the
    timing starts anew). Returns the run and the logit gap of `upcycle_from`."""
    moe_model, gap = upcycle_from(run.model, seed, check)
    dense_state = run.optimizer.state
    moments = {}
    for key in ("exp_avg", "exp_avg_sq"):
        holder = GPTMoEForCausalLM(run.model.config)
        holder.load_state_dict({n: dense_state[p][key] for n, p in run.model.named_parameters()})
        moments[key] = dict(upcycle(as_llama(holder), seed=seed, **UPCYCLE).named_parameters())
    step = next(iter(dense_state.values()))["step"]
    optimizer = make_optimizer(moe_model, s)
    for name, p in moe_model.named_parameters():
        if not name.endswith(".mlp.gate.weight"):  # a router: no state, as a new parameter
            optimizer.state[p] = {"step": step.clone(), **{k: moments[k][name].detach().clone() for k in moments}}
    generator = torch.Generator()
    generator.set_state(run.generator.get_state())
    return Run(moe_model.to(s.device), optimizer, generator, run.step, run.data_order, list(run.curve)), gap


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
    """Total parameters and those one token uses (the model's `num_active_parameters`)."""
    return {"total": model.num_parameters(), "active": model.num_active_parameters()}


def check_blocks(data: dict, s: Setting) -> torch.Tensor:
    """Two held-out windows on which an upcycled model is checked against its dense source."""
    return windows(data["val"], torch.arange(2) * s.block, s.block)


def result(run: Run, s: Setting, started: int = 0) -> dict:
    """What a finished run records: its final held-out loss (the last point's `final_loss`), the curve, FLOPs per
    token, parameters, tokens trained since step `started` (an upcycled run's start), the batch chain and its speed."""
    final = run.curve[-1]
    if "final_loss" not in final:
        raise ValueError(f"the run stopped at step {run.step}, before its budget")
    timing = run.timing
    tokens = timing["steps"] * s.batch * s.block
    return {
        "val_loss": final["final_loss"], "steps": run.step, "curve": run.curve,
        "flops_per_token": flops_per_token(run.model.config, s.block), "params": parameters(run.model),
        "train_tokens": s.tokens(run.step - started), "data_order": run.data_order,
        "tokens_per_s": tokens / timing["wall"] if timing["wall"] else None,
        "tokens_per_cpu_s": tokens / timing["cpu"] if timing["cpu"] else None,
    }
