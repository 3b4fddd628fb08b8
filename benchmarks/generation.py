"""Generation speed on CPU (2 threads by default).

1. Greedy tokens/s of GPT-MoE (an MoE in every layer: 4 layers, hidden 256, 8 experts of inner size 512, top-2)
   against our dense backbone of the same active size (the same model with a dense FFN of inner size 1024) and
   against Transformers' MixtralForCausalLM of the same sizes with each experts implementation
   (eager, grouped_mm, batched_mm); batch 1 and 8, vocab 1k and 32k.
2. Flat beam search against Transformers' beam search on the GPT-MoE model, beams 4 and 8.
3. Where the time of a GPT-MoE decode step goes (forward hooks around the modules, batch 1 and 8).

All variants of a setting run in interleaved rounds inside one process (the order rotates every round), and each
ratio is the median of the per-round ratios, so drift from other load on the machine cancels out.

    python benchmarks/generation.py                  # everything: 2 threads, 5 rounds, 64 new tokens
    python benchmarks/generation.py --rounds 3 --new-tokens 32 --only greedy --threads 1

benchmarks/RESULTS.md was made on a quiet 2-core machine with --rounds 3 --new-tokens 32 --only greedy and
--rounds 5 --only beam; earlier runs (1 thread, --only profile) are in CHANGELOG.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
from hf_ppmoe.generation import flat_beam_search

HIDDEN, LAYERS, HEADS, EXPERTS, TOP_K, EXPERT_INNER = 256, 4, 4, 8, 2, 512
PROMPT = 16
MIXTRAL_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def gpt_moe(vocab: int, dense: bool = False) -> GPTMoEForCausalLM:
    config = GPTMoEConfig(
        vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=TOP_K * EXPERT_INNER, moe_intermediate_size=EXPERT_INNER, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, moe_layer_frequency=1, moe_layers=[] if dense else None,
        max_position_embeddings=512, pad_token_id=0, eos_token_id=None,
    )
    return GPTMoEForCausalLM(config).eval()


def mixtral(vocab: int, implementation: str) -> MixtralForCausalLM:
    config = MixtralConfig(
        vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, intermediate_size=EXPERT_INNER, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, max_position_embeddings=512, pad_token_id=0, eos_token_id=None,
    )
    return MixtralForCausalLM._from_config(config, experts_implementation=implementation).eval()


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(variants: dict, rounds: int) -> dict[str, list[float]]:
    """variants: name -> zero-argument callable. Returns name -> seconds per round."""
    times, names = defaultdict(list), list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(seconds(variants[name]))
    return times


def median_ratio(times, faster, baseline) -> float:
    """Median over rounds of speed(faster) / speed(baseline) = time(baseline) / time(faster)."""
    return statistics.median(b / f for f, b in zip(times[faster], times[baseline]))


def greedy(rounds: int, new_tokens: int) -> list[str]:
    rows = [
        "| vocab | batch | dense tok/s | GPT-MoE tok/s | GPT-MoE / dense | Mixtral eager / dense | "
        "Mixtral grouped_mm / dense | Mixtral batched_mm / dense | GPT-MoE / best Mixtral |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for vocab in (1000, 32000):
        torch.manual_seed(0)
        models = {"dense": gpt_moe(vocab, dense=True), "GPT-MoE": gpt_moe(vocab)}
        models.update({f"Mixtral {impl}": mixtral(vocab, impl) for impl in MIXTRAL_IMPLEMENTATIONS})
        for batch in (1, 8):
            ids = torch.randint(3, vocab, (batch, PROMPT))
            kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            for m in models.values():  # warm-up
                m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            variants = {name: (lambda m=m: m.generate(ids, **kw)) for name, m in models.items()}
            times = interleaved(variants, rounds)
            tps = {name: batch * new_tokens / statistics.median(t) for name, t in times.items()}
            vs_dense = {name: median_ratio(times, name, "dense") for name in models}
            best_mixtral = max(vs_dense[f"Mixtral {impl}"] for impl in MIXTRAL_IMPLEMENTATIONS)
            rows.append(
                f"| {vocab} | {batch} | {tps['dense']:.0f} | {tps['GPT-MoE']:.0f} | {vs_dense['GPT-MoE']:.2f} | "
                + " | ".join(f"{vs_dense[f'Mixtral {impl}']:.2f}" for impl in MIXTRAL_IMPLEMENTATIONS)
                + f" | {vs_dense['GPT-MoE'] / best_mixtral:.2f} |"
            )
            print(rows[-1], flush=True)
    return rows


def beam(rounds: int, new_tokens: int) -> list[str]:
    rows = [
        "| vocab | batch | beams | beam search tok/s | flat beam search tok/s | flat / beam search |",
        "|---|---|---|---|---|---|",
    ]
    for vocab in (1000, 32000):
        torch.manual_seed(0)
        model = gpt_moe(vocab)
        for batch in (1, 8):
            ids = torch.randint(3, vocab, (batch, PROMPT))
            for beams in (4, 8):
                kw = dict(num_beams=beams, max_new_tokens=new_tokens, pad_token_id=0)
                variants = {
                    "beam": lambda: model.generate(ids, **kw),
                    "flat": lambda: model.generate(ids, custom_generate=flat_beam_search, **kw),
                }
                assert torch.equal(variants["beam"](), variants["flat"]())  # also the warm-up
                times = interleaved(variants, rounds)
                tps = {name: batch * new_tokens / statistics.median(t) for name, t in times.items()}
                rows.append(f"| {vocab} | {batch} | {beams} | {tps['beam']:.0f} | {tps['flat']:.0f} | "
                            f"{median_ratio(times, 'flat', 'beam'):.2f} |")
                print(rows[-1], flush=True)
    return rows


def timed_modules(model):
    """(module, kind) pairs whose forward time the profile measures."""
    pairs = [(model.lm_head, "lm_head")]
    for layer in model.model.layers:
        pairs.append((layer.self_attn, "attention"))
        if layer.is_moe:
            pairs += [(layer.mlp, "moe"), (layer.mlp.gate, "gate"), (layer.mlp.experts, "experts")]
        else:
            pairs.append((layer.mlp, "ffn"))
    return pairs


def profile(new_tokens: int) -> list[str]:
    """Where the decode steps of greedy generation (prefill excluded) spend their time, vocab 1k."""
    rows = ["| model | batch | ms / decode step | attention | MoE layer (gate + experts + rest) | dense FFN | lm_head "
            "| rest (norms, embeddings, generate loop) |", "|---|---|---|---|---|---|---|---|"]
    torch.manual_seed(0)
    for name, model in (("GPT-MoE", gpt_moe(1000)), ("dense", gpt_moe(1000, dense=True))):
        for batch in (1, 8):
            ids = torch.randint(3, 1000, (batch, PROMPT))
            kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
            spent, starts, state = defaultdict(float), {}, {"step": 0}

            def new_step(module, args):
                state["step"] += 1
                if state["step"] == 2:  # the first decode step: from here on everything counts
                    state["start"] = time.perf_counter()

            def enter(module, args):
                starts[module] = time.perf_counter()

            def leave(module, args, output, kind):
                if state["step"] >= 2:
                    spent[kind] += time.perf_counter() - starts[module]

            handles = [model.register_forward_pre_hook(new_step)]
            for module, kind in timed_modules(model):
                handles.append(module.register_forward_pre_hook(enter))
                handles.append(module.register_forward_hook(lambda m, a, o, k=kind: leave(m, a, o, k)))
            model.generate(ids, **kw)
            total = time.perf_counter() - state["start"]
            for handle in handles:
                handle.remove()

            def share(kind):
                return f"{100 * spent[kind] / total:.0f}%" if spent[kind] else "-"

            spent["moe rest"] = spent["moe"] - spent["gate"] - spent["experts"]
            spent["rest"] = total - sum(spent[k] for k in ("attention", "moe", "ffn", "lm_head"))
            moe = f"{share('moe')} ({share('gate')} + {share('experts')} + {share('moe rest')})" if spent["moe"] else "-"
            rows.append(f"| {name} | {batch} | {1000 * total / (new_tokens - 1):.2f} | {share('attention')} | {moe} | "
                        f"{share('ffn')} | {share('lm_head')} | {share('rest')} |")
            print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--beam-new-tokens", type=int, default=32)
    parser.add_argument("--only", choices=["greedy", "beam", "profile"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, prompt {PROMPT} tokens\n")
    if args.only in (None, "greedy"):
        print(f"## Greedy, {args.new_tokens} new tokens, medians of {args.rounds} interleaved rounds")
        greedy(args.rounds, args.new_tokens)
    if args.only in (None, "beam"):
        print(f"\n## Beam search on GPT-MoE, {args.beam_new_tokens} new tokens, medians of {args.rounds} rounds")
        beam(args.rounds, args.beam_new_tokens)
    if args.only in (None, "profile"):
        print(f"\n## Where a decode step goes (greedy, vocab 1k, {args.new_tokens} new tokens)")
        profile(args.new_tokens)


if __name__ == "__main__":
    main()
