"""Sharded data parallelism (FSDP2 / HSDP) with TP, PP and wide expert parallelism: memory per rank (4 processes;
every test body runs on all ranks, tests/distributed.py). Their equality with one process is tested through the
training entry point (tests/training)."""

import functools
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.distributed(4)

CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_experts=4, num_experts_per_tok=2, moe_layer_frequency=2)
LAYOUTS = {"whole": {}, "fsdp4": dict(fsdp=4), "replicas2_fsdp2": dict(fsdp=2), "fsdp2_tp2": dict(fsdp=2, tp=2),
           "fsdp2_pp2": dict(fsdp=2, pp=2), "fsdp4_ep4": dict(fsdp=4, ep=4), "tp2_pp2": dict(tp=2, pp=2)}
# (layout, fsdp x tp x pp): every layout shards all of what a replica holds over that many processes
SHARDED = [("fsdp4", 4), ("replicas2_fsdp2", 2), ("fsdp2_tp2", 4), ("fsdp2_pp2", 4), ("fsdp4_ep4", 4)]


@functools.cache  # the processes run every test of the launch: each layout is measured once
def per_rank(layout: str) -> list[dict]:
    """Every rank's bytes of parameters, gradients and AdamW state after one training step in `layout`
    (benchmarks/memory.py's measurement, on a small model); "whole" is the unsplit model."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.memory import measure

    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, measure(LAYOUTS[layout], CONFIG))
    return ranks


def totals(layout):
    return [sum(rank.values()) for rank in per_rank(layout)]


@pytest.mark.parametrize("layout, split", SHARDED)
def test_state_per_rank_scales_as_one_over_fsdp_tp_pp(layout, split):
    """Parameters + gradients + AdamW state of the largest rank: the whole model's / (fsdp x tp x pp), up to what is
    not sharded that way (tensor parallelism keeps norms and routers whole, FSDP pads dim 0): at most 1% above."""
    whole = totals("whole")[0]
    assert max(totals(layout)) == pytest.approx(whole / split, rel=0.01)


def test_fsdp_partitions_every_tensor():
    """--fsdp_size 4: the 4 ranks' shards of parameters, gradients and AdamW moments add up to the whole model's, byte
    for byte (each tensor is split, none is held twice)."""
    ranks, whole = per_rank("fsdp4"), per_rank("whole")[0]
    for kind in ("params", "grads", "optimizer"):
        assert sum(rank[kind] for rank in ranks) == whole[kind], kind


def test_tensor_and_pipeline_parallel_without_fsdp_replicate_the_rest():
    """tp 2 x pp 2 without FSDP: the same 1/4 for the split weights, but the gradient of the vocabulary-split
    embedding comes back whole (Replicate) from Transformers' embedding rule, so the first stage holds more: FSDP's
    reduce-scatter removes that (fsdp2_tp2 above)."""
    whole = totals("whole")[0]
    assert whole / 4 * 1.02 < max(totals("tp2_pp2")) < whole / 4 * 1.1


def test_reshard_after_forward_false_keeps_the_gathered_layers_until_backward():
    """Issue 31: `--fsdp_reshard_after_forward false` (Accelerate's FSDP2 option, FSDP1's SHARD_GRAD_OP) reaches
    FSDP2: after a forward each layer still holds its gathered (plain) parameters; with the default, its shards
    (DTensors). The backward works either way and leaves the sharded parameters with their gradients."""
    import torch
    from torch.distributed.tensor import DTensor

    from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
    from hf_ppmoe.parallel import fully_shard_model, make_mesh

    mesh = make_mesh(fsdp=4)
    for reshard in (True, False):
        torch.manual_seed(0)
        model = GPTMoEForCausalLM(GPTMoEConfig(**CONFIG))
        fully_shard_model(model, mesh, reshard_after_forward=reshard)
        ids = torch.randint(0, CONFIG["vocab_size"], (2, 8))
        loss = model(ids, labels=ids).loss
        layer = model.model.layers[1]
        assert isinstance(next(layer.parameters()), DTensor) == reshard, reshard
        loss.backward()
        assert all(isinstance(p, DTensor) and p.grad is not None for p in layer.parameters()), reshard


def test_fsdp_with_tensor_parallel_returns_logits_of_their_own():
    """Issue 46: under FSDP2 x TP the head's gathered logits were `DTensor.to_local()`'s view, and FSDP2 warned on
    every step that the model returned a view (an in-place op on one skips its pre-backward hook). They are a tensor of
    their own now ("colwise_gathered"), with the single-process model's logits, loss and gradients."""
    import copy
    import warnings

    import torch

    from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
    from hf_ppmoe.parallel import fully_shard_model, make_mesh, parallelize

    torch.manual_seed(0)
    reference = GPTMoEForCausalLM(GPTMoEConfig(**CONFIG))
    model = copy.deepcopy(reference)
    mesh = make_mesh(fsdp=2, tp=2)
    parallelize(model, mesh["tp"])
    fully_shard_model(model, mesh)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(dist.get_rank() // 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(ids, labels=ids)
    assert not [w for w in caught if "view tensor" in str(w.message)], [str(w.message) for w in caught]
    assert out.logits._base is None
    out.loss.backward()
    expected = reference(ids, labels=ids)
    expected.loss.backward()
    torch.testing.assert_close(out.logits, expected.logits, atol=1e-5, rtol=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        # FSDP averages over its 2 ranks, which read different batches: the mean of their single-process gradients
        grad = q.grad.clone()
        dist.all_reduce(grad, group=mesh["fsdp"].get_group())
        torch.testing.assert_close(p.grad.full_tensor(), grad / 2, atol=1e-5, rtol=1e-4, msg=name)
