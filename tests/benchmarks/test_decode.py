"""benchmarks/decode.py at its smallest (one request, one round, two tokens): both models, both modes, every request's
tokens equal to `generate`'s, and the rows the RESULTS.md table is made of. No times are asserted."""

import argparse

from helpers import load_benchmark


def test_decode_benchmark_rows():
    decode = load_benchmark("decode")
    models = {name: decode.build(name, "cpu") for name in ("gpt_moe", "qwen3_moe")}
    args = argparse.Namespace(rounds=1, new_tokens=2)
    rows = decode.measure(models, 2, args, dict(num_blocks=16, max_batch_tokens=128, page_size=32))
    assert [(r["model"], r["mode"]) for r in rows] == [
        ("gpt_moe", "generate"), ("gpt_moe", "continuous batching"),
        ("qwen3_moe", "generate"), ("qwen3_moe", "continuous batching"),
    ]
    assert all(r["same_tokens_as_generate"] and r["tokens_per_s"] > 0 and r["ttft_ms"] > 0 for r in rows)
