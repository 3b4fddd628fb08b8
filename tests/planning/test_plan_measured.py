"""The planner against what CPU ranks hold and send (issue 43, items 2 and 3), in one 4-process launch and one
2-process launch (gloo): for layouts of three model shapes, split exactly as `python -m hf_ppmoe.training` splits them,
every rank's state (parameters, gradients, AdamW state: `hf_ppmoe.parallel.state_bytes`) equals the prediction, the
bytes autograd holds for the backward (saved-tensor hooks) are within 5% of it, and the collectives of a step are the
predicted ones, byte for byte; one MoE layer's collectives equal what benchmarks/expert_parallel.py counts for PPMoE,
Transformers' all-reduce and all-to-all expert parallelism.

The measuring code is benchmarks/plan.py's (and expert_parallel.py's): the test holds the benchmark's numbers."""

import types
from collections import Counter

import pytest

from helpers import load_benchmark


# (shape, layout, micro-batch, sequence length, pipeline microbatches): benchmarks/plan.py's shapes, 4 processes
CASES = [
    ("llama", {"fsdp": 2, "tp": 2}, 2, 32, 1),
    ("llama", {"tp": 2}, 2, 32, 1),  # two replicas: FSDP2 with shard groups of one (the embedding's gradient)
    ("gpt2", {"tp": 2, "pp": 2}, 2, 64, 2),  # tied head on the last stage, 1F1B
    ("gpt2", {"fsdp": 2, "pp": 2}, 1, 64, 4),  # FSDP inside pipeline stages, the tied copies' gradients
    ("llama", {"fsdp": 4, "ep": 4}, 2, 64, 1),  # all-to-all, balanced routes replayed
    ("gqa-bf16", {"fsdp": 2, "tp": 2, "ep": 4}, 2, 64, 1),  # bf16, GQA, all-to-all within and across TP
    ("gqa-bf16", {"tp": 2, "pp": 2}, 2, 32, 2),  # bf16 PPMoE: its all-reduces in 16 bits
    ("llama-autocast", {"fsdp": 2, "pp": 2}, 2, 32, 2),  # float32 weights, bf16 autocast: 16-bit weight copies
]


@pytest.mark.distributed(4)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in c[1].items())}")
def test_state_activations_and_collectives_per_rank(case):
    """State exact, activations within 5%, the step's collectives (op and bytes) exactly the predicted ones."""
    import torch.distributed as dist

    plan = load_benchmark("plan")
    shape, sizes, micro_batch, seq_len, microbatches = case
    world, rank = dist.get_world_size(), dist.get_rank()
    measured = plan.measure(shape, sizes, micro_batch, seq_len, microbatches)
    predicted = plan.predict(shape, sizes, world, micro_batch, seq_len, microbatches)[rank]
    assert measured["state"] == predicted["state"]
    assert abs(predicted["activations"] / measured["activations"] - 1) < 0.05, (measured, predicted)
    expected = plan.predicted_collectives(shape, sizes, world, rank, micro_batch, seq_len, microbatches)
    counted = measured["collectives"]
    assert counted == expected, (Counter(counted) - Counter(expected), Counter(expected) - Counter(counted))


@pytest.mark.distributed(2)
def test_moe_layer_collectives_equal_the_expert_parallel_benchmark():
    """Per collective, in order, forward and backward: PPMoE (one all-reduce [T, H] each way and the routing weights'
    [T, K]), Transformers' all-reduce EP (the same), Transformers' all-to-all EP (counts, rows out and back, the
    tensor-parallel all-gathers), with balanced routes replayed."""
    bench = load_benchmark("expert_parallel")
    args = types.SimpleNamespace(tokens=64, hidden=32, inner=64, layers=1, experts=4, topk=2)
    routes = bench.balanced_routes(args)
    for variant in (("ppmoe", "index"), ("all_reduce", "index"), ("all_to_all", "index")):
        model = bench.build(args, *variant)
        assert bench.layer_collectives(model, args, routes) == bench.planned_collectives(args, variant), variant
