"""Sharded data parallelism (FSDP2 / HSDP) with TP, PP and wide expert parallelism: memory per rank (4 processes).
Their equality with one process is tested through the training entry point (tests/training)."""

import pytest

# (layout, fsdp x tp x pp): every layout shards all of what a replica holds over that many processes
SHARDED = [("fsdp4", 4), ("replicas2_fsdp2", 2), ("fsdp2_tp2", 4), ("fsdp2_pp2", 4), ("fsdp4_ep4", 4)]


def totals(ranks, layout):
    return [sum(rank[layout].values()) for rank in ranks]


@pytest.mark.parametrize("layout, split", SHARDED)
def test_state_per_rank_scales_as_one_over_fsdp_tp_pp(four_ranks, layout, split):
    """Parameters + gradients + AdamW state of the largest rank: the whole model's / (fsdp x tp x pp), up to what is
    not sharded that way (tensor parallelism keeps norms and routers whole, FSDP pads dim 0): at most 1% above."""
    ranks = four_ranks("sharded_memory")
    whole = totals(ranks, "whole")[0]
    assert max(totals(ranks, layout)) == pytest.approx(whole / split, rel=0.01)


def test_fsdp_partitions_every_tensor(four_ranks):
    """--fsdp_size 4: the 4 ranks' shards of parameters, gradients and AdamW moments add up to the whole model's, byte
    for byte (each tensor is split, none is held twice)."""
    ranks = four_ranks("sharded_memory")
    for kind in ("params", "grads", "optimizer"):
        assert sum(rank["fsdp4"][kind] for rank in ranks) == ranks[0]["whole"][kind], kind


def test_tensor_and_pipeline_parallel_without_fsdp_replicate_the_rest(four_ranks):
    """tp 2 x pp 2 without FSDP: the same 1/4 for the split weights, but the gradient of the vocabulary-split
    embedding comes back whole (Replicate) from Transformers' embedding rule, so the first stage holds more: FSDP's
    reduce-scatter removes that (fsdp2_tp2 above)."""
    ranks = four_ranks("sharded_memory")
    whole = totals(ranks, "whole")[0]
    assert whole / 4 * 1.02 < max(totals(ranks, "tp2_pp2")) < whole / 4 * 1.1
