"""benchmarks/gpu.py plans before it runs: every case is sized against the card's memory and skipped with the reason
where it cannot fit (`--plan` shows it without a GPU); MFU counts attention and uses the named card's own peak."""

import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def gpu():
    return load_benchmark("gpu")


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

    args = argparse.Namespace(tokens=64, hidden=32, inner=16, experts=[4], topk=[2], rounds=1, warmup=1)
    args.memory = gpu.estimate_layer("qwen3-batched_mm", 64, 32, 16, 4, 2) / gpu.USABLE - 1
    lines = gpu.layer_section(args, torch.device("cpu"), torch.bfloat16, gpu.Timer(torch.device("cpu")))
    rows = [line.strip("| ").split(" | ") for line in lines[4:]]
    assert [row[2] for row in rows] == ["train", "forward"]
    for row in rows:
        ours, grouped, batched = row[4:]
        assert ours.endswith("x") and grouped.endswith("x"), row
        assert batched.startswith("skipped: needs"), row


def test_plan_sizes_transformers_qwen3_moe_beside_ours_in_training_and_decoding(gpu):
    rows = {line.split(" | ")[1] for line in gpu.main(["--plan"]) if line.startswith("| ")}
    assert {"Qwen3-MoE E=8 k=2 B=8 S=2048", "Qwen3-MoE grouped_mm batch 1", "Qwen3-MoE grouped_mm batch 32"} <= rows


def _full_args(gpu):
    import argparse

    return argparse.Namespace(model_hidden=2048, model_inner=1408, model_layers=8)


def test_qwen3_moe_has_the_shape_of_our_moe_model(gpu):
    """Same hidden size, layers, heads, experts, routes and expert size, so tokens/s compare like for like."""
    models = gpu.training_models(_full_args(gpu))
    ours, _ = models["GPT-MoE E=8 k=2"]
    qwen, _ = models["Qwen3-MoE E=8 k=2"]
    for a, b in (("hidden_size", "hidden_size"), ("num_hidden_layers", "num_hidden_layers"),
                 ("num_attention_heads", "num_attention_heads"), ("num_key_value_heads", "num_key_value_heads"),
                 ("num_experts", "num_experts"), ("num_experts_per_tok", "num_experts_per_tok"),
                 ("intermediate_size", "moe_intermediate_size"), ("vocab_size", "vocab_size")):
        assert getattr(ours, a) == getattr(qwen, b), a
    assert qwen._experts_implementation == "grouped_mm" and qwen.mlp_only_layers == []
    assert gpu.parameters(ours, False)[1] == gpu.parameters(qwen, False)[1]  # equal active parameters


def test_graph_count_sees_a_graph_break_and_is_fresh_per_variant(gpu):
    import torch

    def breaks(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    gpu.fresh_dynamo()
    torch.compile(breaks)(torch.ones(3))
    graphs, n = gpu.dynamo_graphs()
    assert graphs == 2 and n == 1
    assert "2 graphs, 1 graph breaks" in gpu.graph_problem("training toy", graphs, n, True)
    gpu.fresh_dynamo()  # the next variant starts from nothing
    torch.compile(lambda x: x * 3)(torch.ones(3))
    assert gpu.dynamo_graphs() == (1, 0)
    assert gpu.graph_problem("training toy", 1, 0, True) == ""
    assert gpu.graph_problem("decode Qwen3-MoE grouped_mm batch 1", 9, 8, True) == ""  # the reference: reported only
    assert gpu.graph_problem("decode GPT-MoE batch 1", 9, 0, True) != ""  # a recompile of ours fails the run


def test_training_section_times_each_model_alone_against_dense_and_qwen3(gpu):
    """The real section on CPU at toy sizes, eager (no compile): one row per model, ratios to both references."""
    import argparse

    import torch

    args = argparse.Namespace(batch=1, seq=16, model_hidden=64, model_inner=32, model_layers=1, compile=False,
                              rounds=1, warmup=1, min_decode_rounds=1, memory=None)
    problems = []
    lines = gpu.training_section(args, torch.device("cpu"), torch.float32, gpu.Timer(torch.device("cpu")), problems)
    rows = {r[0]: r[1:] for r in (line.strip("| ").split(" | ") for line in lines[4:])}
    assert set(rows) == {"dense backbone", "GPT-MoE E=8 k=2", "Qwen3-MoE E=8 k=2"}
    assert rows["dense backbone"][2] == "1.00x" and rows["Qwen3-MoE E=8 k=2"][3] == "1.00x"
    assert all(r[2].endswith("x") and r[3].endswith("x") and r[5] == "0 / 0" for r in rows.values()), rows
    assert problems == ["", "", ""]
