"""benchmarks/gpu.py plans before it runs: every case is sized against the card's memory and skipped with the reason
where it cannot fit (`--plan` shows it without a GPU); MFU counts attention and uses the named card's own peak."""

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def gpu():
    spec = importlib.util.spec_from_file_location("benchmarks_gpu", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_lists_every_case_and_skips_what_cannot_fit(gpu, capsys):
    lines = gpu.main(["--plan"])
    assert capsys.readouterr().out.strip() == "\n".join(lines).strip()
    rows = {cells[1]: cells[2:] for cells in (line.strip("| ").split(" | ") for line in lines if line.startswith("| "))}
    cases = [f"E={E} k={k} {v}" for E in (8, 32, 128) for k in (1, 2, 8) for v in gpu.LAYER_VARIANTS]
    assert set(cases) <= set(rows), sorted(set(cases) - set(rows))
    # Transformers' batched_mm gathers [T*k, 2f, H] weights: 176 GiB at E=8, k=1 before its gradient
    gib, on_80, on_141 = rows["E=8 k=1 qwen3-batched_mm"]
    assert float(gib.replace(",", "")) >= 176
    assert on_80.startswith("skipped: needs") and on_141.startswith("skipped: needs")
    for case in ("E=128 k=8 ours", "E=128 k=8 qwen3-grouped_mm", "GPT-MoE E=8 k=2 B=8 S=2048", "GPT-MoE batch 32"):
        assert rows[case][1:] == ["runs", "runs"], case


def test_layer_estimate_grows_with_what_each_variant_keeps(gpu):
    T, H, f = 16384, 2048, 1408
    assert gpu.estimate_layer("qwen3-batched_mm", T, H, f, 8, 2) >= 2 * 2 * T * 2 * f * H  # copy + its gradient
    assert gpu.estimate_layer("ours", T, H, f, 128, 8) > gpu.estimate_layer("ours", T, H, f, 8, 8)
    assert gpu.fits(gpu.estimate_layer("ours", T, H, f, 128, 8), 80e9) == ""
    assert "skipped" in gpu.fits(gpu.estimate_layer("qwen3-batched_mm", T, H, f, 8, 1), 141e9)


def test_mfu_counts_attention_and_looks_up_the_card(gpu):
    config = gpu.moe_config(2048, 1408, 8, 2, layers=8)
    short, long = gpu.flops_per_token(config, False, 128), gpu.flops_per_token(config, False, 4096)
    assert long - short == 12 * 8 * 2048 * (4096 - 128)
    assert gpu.peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0  # SXM
    assert gpu.peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu.peak_bf16_tflops("NVIDIA H100 NVL") == 835.0
    assert gpu.peak_bf16_tflops("NVIDIA H200") == 989.0
    assert gpu.peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu.peak_bf16_tflops("NVIDIA L4") == 121.0
    assert gpu.peak_bf16_tflops("NVIDIA L40S") == 362.0
    assert gpu.peak_bf16_tflops("NVIDIA GeForce RTX 4090") is None


def test_layer_section_skips_a_case_that_cannot_fit_and_measures_the_rest(gpu):
    """The real section on CPU at toy sizes, with a 'card' just too small for batched_mm's weight copies."""
    import argparse

    import torch

    args = argparse.Namespace(tokens=64, hidden=32, inner=16, experts=[4], topk=[2], rounds=1)
    args.memory = gpu.estimate_layer("qwen3-batched_mm", 64, 32, 16, 4, 2) / gpu.USABLE - 1
    lines = gpu.layer_section(args, torch.device("cpu"), torch.bfloat16, gpu.Timer(torch.device("cpu")))
    rows = [line.strip("| ").split(" | ") for line in lines[4:]]
    assert [row[2] for row in rows] == ["train", "forward"]
    for row in rows:
        ours, grouped, batched = row[4:]
        assert ours.endswith("x") and grouped.endswith("x"), row
        assert batched.startswith("skipped: needs"), row
