"""The CPU proxy of the GPU layer benchmark (benchmarks/traffic.py), held as a line: at the GPU benchmark's shapes, on
the meta device, our MoE layer moves no more non-GEMM bytes than Transformers' Qwen3-MoE block with grouped_mm and
launches no more kernels than it, plus the router losses ours computes in training (and, in a forward with k > 1,
one: the index clamp that gives the anchor rows a token). Device-independent counts only; the GPU's times are
benchmarks/gpu.py's."""


import pytest

from helpers import load_benchmark

T, H, F = 16384, 2048, 1408  # benchmarks/gpu.py's layer shapes


@pytest.fixture(scope="module")
def traffic():
    return load_benchmark("traffic")


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("E", [8, 32, 128])
def test_ours_moves_fewer_bytes_and_launches_no_more_kernels_than_qwen3(traffic, E, k):
    ours = traffic.measure(traffic.ours(H, F, E, k), T, H)
    qwen = traffic.measure(traffic.qwen3(H, F, E, k), T, H)
    without_losses = traffic.count_train(traffic.ours(H, F, E, k, losses=False), T, H)
    router_losses = ours["train"].kernels - without_losses.kernels
    for mode in ("train", "forward"):
        assert ours[mode].gemm_flops == pytest.approx(qwen[mode].gemm_flops, rel=0.01), mode  # the same work
        assert ours[mode].other_bytes <= qwen[mode].other_bytes, (mode, ours[mode].ops, qwen[mode].ops)
    assert without_losses.kernels <= qwen["train"].kernels, (without_losses.ops, qwen["train"].ops)
    # aux (counts, mean probabilities), z-loss, routes per expert, dropped fraction; the routes each expert was
    # assigned and the real tokens, which LoadBalancer sums per step, only with the "global_batch" loss scope
    assert router_losses <= 12
    assert ours["forward"].kernels <= qwen["forward"].kernels + (k > 1), (ours["forward"].ops, qwen["forward"].ops)


def test_the_counter_sees_what_it_counts(traffic):
    """A masked [E, in, out] weight gradient (what the old backward did) is bytes the counter reports, and a view is
    no kernel."""
    import torch

    w = torch.empty(128, 2048, 2816, device="meta", dtype=torch.bfloat16)
    keep = torch.empty(128, 1, 1, device="meta", dtype=torch.bool)
    counts = traffic.count(lambda: (w.transpose(1, 2), torch.where(keep, w, 0.0)))
    assert "transpose.int" not in counts.ops and counts.ops["where.self"] == 1
    assert counts.other_bytes >= 2 * w.numel() * w.element_size()
