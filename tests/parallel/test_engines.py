"""Other engines on our models, 2 processes (gloo), against one process; see worker.py.

- DeepSpeed ZeRO-3 through Accelerate (DeepSpeed's CPU accelerator on gloo).
"""

import pytest

# AdamW divides each update by the running gradient scale, so parameters whose gradients are tiny take float-noise
# differences of the gradients into their updates at full learning rate: parameters after a few AdamW steps are
# compared at this tolerance (losses at 1e-5, as elsewhere).
ADAM_ATOL = 5e-5


@pytest.mark.parametrize("family", ["gpt", "seq2seq"])
def test_deepspeed_zero3_equals_one_process(two_ranks, family):
    """ZeRO-3 gathers a module's parameters for its backward through hooks on the tensors of its output; the gates'
    `Routing` is a NamedTuple so that DeepSpeed finds them (a dataclass hid them: "The size of tensor a (0) must
    match the size of tensor b (H)" in the router's backward). GPT-MoE is loaded partitioned (ZeRO-3 init)."""
    ranks = two_ranks("deepspeed_zero3")
    if "skipped" in ranks[0]:
        pytest.skip(ranks[0]["skipped"])
    for rank in ranks:
        result = rank[family]
        assert result["processes"] == 2
        for i, step in enumerate(result["steps"]):
            assert step["loss"] == pytest.approx(step["ref_loss"], abs=1e-5), f"step {i}"
        assert result["params_after"] < ADAM_ATOL
    if family == "gpt":
        assert all(rank["gpt"]["numel_at_load"] == 0 for rank in ranks)  # every parameter partitioned at load
