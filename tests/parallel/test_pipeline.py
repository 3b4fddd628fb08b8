"""Pipeline parallelism (2 processes) and TP x PP (4 processes) against single-process gradient accumulation."""

import pytest
from worker import ATOL

from hf_ppmoe.parallel import split_layers


def assert_matches(result):
    for i, step in enumerate(result["steps"]):
        assert step["loss"] == pytest.approx(step["ref_loss"], abs=1e-5), f"step {i}"
        assert step["grad"] < ATOL, f"step {i}: gradients differ by {step['grad']}"
    assert result["params_after"] < ATOL


@pytest.mark.parametrize("case", ["gpipe/llama", "gpipe/gpt2", "1f1b/llama", "1f1b/gpt2"])
def test_two_stages_equal_single_process(two_ranks, case):
    for rank in two_ranks("pipeline_two_stages"):
        assert_matches(rank[case])


@pytest.mark.parametrize("case", ["gpipe/llama", "1f1b/gpt2"])
def test_tp_times_pp_equals_single_process(four_ranks, case):
    for rank in four_ranks("tp_times_pp"):
        assert_matches(rank[case])


def test_split_layers():
    assert split_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    with pytest.raises(ValueError, match="at least as many layers"):
        split_layers(2, 3)
