"""Seq2Seq-MoE against Transformers' SwitchTransformersForConditionalGeneration (same sizes: 8 experts, top-1, MoE
in every other FFN of both stacks, ReLU FFN, tied rescaled head, no dropout, no token dropped) and against our own
dense backbone (the same model with no MoE layers): training step time and greedy-generation tokens/s.

All models live in one process and are timed in interleaved rounds: each round runs one training step, then one
greedy generation, of every model, in a fresh random order. Each result is the median over rounds of the per-round
ratio, so the slow phases of a shared machine hit both sides of a ratio alike.

    python benchmarks/seq2seq.py                 # the recorded settings
    python benchmarks/seq2seq.py --rounds 3      # quicker, noisier
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

from hf_ppmoe import Seq2SeqMoEConfig, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.conversion import ARCHITECTURES
from hf_ppmoe.conversion.io import model_tensors
from hf_ppmoe.conversion.mapping import materialize


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--src-len", type=int, default=128)
    p.add_argument("--tgt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated per sequence")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4, help="per stack")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--experts_implementation", default="index")
    return p.parse_args(argv)


def build_models(a):
    common = dict(num_attention_heads=a.heads, head_dim=a.hidden // a.heads)
    ours_kwargs = dict(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
        num_decoder_layers=a.layers, hidden_act="relu", gated_mlp=False, attention_scaling=1.0,
        tie_word_embeddings=True, scale_decoder_outputs=True, num_experts=a.experts, num_experts_per_tok=1,
        router_type="switch", capacity_factor=None, moe_layer_frequency=2, experts_implementation=a.experts_implementation,
        router_aux_loss_coef=0.001, router_z_loss_coef=0.001, **common,
    )
    ours = Seq2SeqMoEForConditionalGeneration(Seq2SeqMoEConfig(**ours_kwargs))
    dense = Seq2SeqMoEForConditionalGeneration(
        Seq2SeqMoEConfig(**{**ours_kwargs, "encoder_moe_layers": [], "decoder_moe_layers": []})
    )
    switch = SwitchTransformersForConditionalGeneration(
        SwitchTransformersConfig(
            vocab_size=a.vocab, d_model=a.hidden, d_kv=a.hidden // a.heads, d_ff=a.ffn, num_layers=a.layers,
            num_decoder_layers=a.layers, num_sparse_encoder_layers=a.layers // 2, num_sparse_decoder_layers=a.layers // 2,
            num_heads=a.heads, num_experts=a.experts, expert_capacity=max(a.src_len, a.tgt_len, a.new_tokens + 1),
            router_jitter_noise=0.0, dropout_rate=0.0, dense_act_fn="relu", tie_word_embeddings=True,
            router_aux_loss_coef=0.001, router_z_loss_coef=0.001, decoder_start_token_id=0,
        )
    )
    load_switch_weights(ours, switch)
    dense.load_state_dict({k: v for k, v in ours.state_dict().items() if ".mlp." not in k}, strict=False)
    moe_layers = lambda m, stack: [i for i, l in enumerate(getattr(m.model, stack).layers) if l.is_moe]  # noqa: E731
    sparse = lambda stack: [i for i, b in enumerate(getattr(switch, stack).block) if b.is_sparse]  # noqa: E731
    assert moe_layers(ours, "encoder") == sparse("encoder") and moe_layers(ours, "decoder") == sparse("decoder")
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(ours) == n(switch), (n(ours), n(switch))
    return {"ours": ours, "switch": switch, "dense": dense}


@torch.no_grad()
def load_switch_weights(ours, switch):
    """Switch's weights into ours through the import table (hf_ppmoe.conversion.t5.switch_rules), so that both
    route every token to the same expert and do the same work."""
    tensors = model_tensors(switch)
    mapping = ARCHITECTURES["switch_transformers"].mapping(switch.config, frozenset(tensors.keys()))
    missing, unexpected = ours.load_state_dict(materialize(mapping.apply(tensors)), strict=False)
    assert not unexpected and all(name.endswith("embed_tokens.weight") or name == "lm_head.weight" for name in missing)


def make_batch(a, generator):
    ids = torch.randint(2, a.vocab, (a.batch, a.src_len), generator=generator)
    mask = torch.ones_like(ids)
    labels = torch.randint(2, a.vocab, (a.batch, a.tgt_len), generator=generator)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def train_time(model, optimizer, batch, extra) -> float:
    """Seconds of one training step: forward with router losses, backward, AdamW step."""
    model.train()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    model(**batch, **extra).loss.backward()
    optimizer.step()
    return time.perf_counter() - start


@torch.no_grad()
def generate_tokens_per_s(model, batch, new_tokens) -> float:
    model.eval()
    start = time.perf_counter()
    out = model.generate(
        batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0,
    )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == new_tokens + 1
    return batch["input_ids"].shape[0] * new_tokens / elapsed


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    models = build_models(a)
    # fused AdamW (CPU-capable since torch 2.4) for all three: the step costs in proportion to the parameters, and
    # the MoE models hold 8 copies of every MoE FFN, so the plain per-tensor loop would mostly time the optimizer
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for name, m in models.items()}
    # Switch computes (and adds to the loss) its router losses only when asked; ours always does
    extra = {"ours": {}, "dense": {}, "switch": {"output_router_logits": True}}
    batch = make_batch(a, torch.Generator().manual_seed(0))
    with torch.no_grad():  # same weights, same routing: the two implementations compute the same logits
        logits = {n: models[n].eval()(**batch).logits for n in ("ours", "switch")}
        torch.testing.assert_close(logits["ours"], logits["switch"], atol=1e-4, rtol=1e-4)
    for name, model in models.items():  # warm-up: allocator, kernels, lazy inits
        train_time(model, optimizers[name], batch, extra[name])
        generate_tokens_per_s(model, batch, 4)

    order = list(models)
    rnd = random.Random(0)
    train, gen = {n: [] for n in models}, {n: [] for n in models}
    for r in range(a.rounds):
        rnd.shuffle(order)
        for name in order:
            train[name].append(train_time(models[name], optimizers[name], batch, extra[name]))
        rnd.shuffle(order)
        for name in order:
            gen[name].append(generate_tokens_per_s(models[name], batch, a.new_tokens))
        print(
            f"round {r}: train s/step " + " ".join(f"{n}={train[n][-1]:.3f}" for n in models)
            + " | gen tok/s " + " ".join(f"{n}={gen[n][-1]:.0f}" for n in models),
            flush=True,
        )

    def median_ratio(values, num, den, invert=False):
        ratios = [(d / n) if invert else (n / d) for n, d in zip(values[num], values[den])]
        return statistics.median(ratios), min(ratios), max(ratios)

    results = {
        "training speed, ours vs SwitchTransformers (x, > 1 is faster)": median_ratio(train, "ours", "switch", True),
        "training throughput, ours MoE vs our dense backbone (x)": median_ratio(train, "ours", "dense", True),
        "greedy generation tokens/s, ours vs SwitchTransformers (x)": median_ratio(gen, "ours", "switch"),
        "greedy generation tokens/s, ours MoE vs our dense backbone (x)": median_ratio(gen, "ours", "dense"),
    }
    print(
        f"\nsettings: torch {torch.__version__}, {a.threads} threads, batch {a.batch}, source {a.src_len}, "
        f"target {a.tgt_len}, {a.new_tokens} new tokens, d_model {a.hidden}, d_ff {a.ffn}, heads {a.heads}, "
        f"{a.layers}+{a.layers} layers (MoE at 1, 3, ...), {a.experts} experts top-1, vocab {a.vocab}, "
        f"experts {a.experts_implementation}, fused AdamW, {a.rounds} rounds"
    )
    for name in models:
        print(
            f"  {name:7s} train {statistics.median(train[name]) * 1e3:7.1f} ms/step   "
            f"generate {statistics.median(gen[name]):7.1f} tokens/s   (medians)"
        )
    for label, (median, low, high) in results.items():
        print(f"  {label}: {median:.2f} (per-round range {low:.2f}-{high:.2f})")
    return results


if __name__ == "__main__":
    main()
