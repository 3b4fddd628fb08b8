"""tests/distributed.py, which runs the multi-process tests: bodies run on every rank, and a rank's failed assert is
raised in pytest's process with that rank's traceback."""

import pytest
import torch
import torch.distributed as dist
from distributed import Case, raise_failure, run


@pytest.mark.distributed(2)
def test_every_rank_runs_the_body():
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x)
    assert dist.get_world_size() == 2 and x.item() == 1.0


def passes():
    dist.barrier()


def fails_on_rank_1():
    assert dist.get_rank() != 1, "rank 1's assert"


def leaves_on_rank_1():
    if dist.get_rank() == 1:
        raise SystemExit


def test_a_failure_is_raised_with_its_rank_assert_and_traceback():
    """The tests after one where a rank left (or failed) run in a new launch: a failure is reported once, by its own
    test."""
    names = ["passes", "leaves_on_rank_1", "fails_on_rank_1"]  # two launches: the second starts at the third test
    outcomes = run([Case(str(i), __name__, __file__, name, {}) for i, name in enumerate(names)], world_size=2)
    assert outcomes["0"].passed == outcomes["1"].passed == {0, 1} and outcomes["2"].passed == {0}
    assert set(outcomes["2"].failures) == {1} and not outcomes["0"].failures and not outcomes["1"].failures
    with pytest.raises(AssertionError, match="rank 1's assert") as error:
        raise_failure(outcomes["2"], world_size=2)
    assert "rank 1 of 2" in str(error.value.__cause__) and "in fails_on_rank_1" in str(error.value.__cause__)
