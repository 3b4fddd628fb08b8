"""benchmarks/quantization.py at its smallest (--smoke: tiny shapes, one round, one seed, a few training steps): every
row the RESULTS.md tables are made of, GPT-MoE's experts stored quantized where Transformers' Qwen3-MoE's are not.
No times are asserted."""


import pytest

from helpers import load_benchmark

pytest.importorskip("bitsandbytes", reason="the quantization benchmark needs bitsandbytes (the test extra)")
pytest.importorskip("trl", reason="the quantization benchmark names trl's version (the test extra)")

def test_quantization_benchmark_rows(tmp_path):
    bench = load_benchmark("quantization")
    result = bench.main(["--smoke", "--json", str(tmp_path / "q.json")])
    rows = {(r["model"], r["load"]): r for r in result["footprint"]}
    assert set(rows) == {(m, load) for m in ("gpt_moe", "qwen3_moe") for load in bench.LOADS}
    for load in ("8-bit", "4-bit"):
        assert rows[("gpt_moe", load)]["experts_quantized"] and not rows[("qwen3_moe", load)]["experts_quantized"]
        assert rows[("gpt_moe", load)]["footprint_vs_bf16"] < rows[("qwen3_moe", load)]["footprint_vs_bf16"]
    assert rows[("gpt_moe", "4-bit")]["footprint_vs_bf16"] < rows[("gpt_moe", "8-bit")]["footprint_vs_bf16"] < 1
    assert [(r["config"], r["seed"]) for r in result["logit_error"]] == [("nf4", 0), ("fp4", 0), ("int8", 0)]
    assert all(r["moe_error"] > 0 and r["dense_error"] > 0 for r in result["logit_error"])
    assert [r["arm"] for r in result["held_out"]] == ["moe_scratch", "dense"]
    assert (tmp_path / "q.json").exists()
