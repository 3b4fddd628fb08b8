"""Other engines on our models, 2 processes (gloo), against one process; see worker.py.

- Transformers' `Trainer` on models sharded at load time by `DistributedConfig` (examples/trainer_distributed.py):
  what runs on CPU; a tensor-parallel layout needs GPUs (Accelerate refuses its ParallelismConfig on CPU).
- DeepSpeed ZeRO-3 through Accelerate (DeepSpeed's CPU accelerator on gloo).
"""

import pytest

# AdamW divides each update by the running gradient scale, so parameters whose gradients are tiny take float-noise
# differences of the gradients into their updates at full learning rate: parameters after a few AdamW steps are
# compared at this tolerance (losses at 1e-5, as elsewhere).
ADAM_ATOL = 5e-5


@pytest.mark.parametrize("run", ["gpt/fsdp2_ep2_all_to_all", "seq2seq/fsdp2"])
def test_trainer_with_distributed_config_equals_one_process(two_ranks, run):
    """GPT-MoE: FSDP2 x all-to-all expert parallelism over the FSDP ranks, 2 gradient accumulation steps;
    Seq2Seq-MoE: FSDP2. Per-step losses and the parameters after training = one process accumulating the same
    micro-batches (clipping, AdamW)."""
    for rank in two_ranks("trainer_distributed_config"):
        result = rank[run]
        assert len(result["losses"]) == len(result["ref_losses"]) == 2
        assert result["loss_diff"] < 1e-5
        assert result["param_diff"] < ADAM_ATOL


def test_trainer_with_tensor_parallelism_needs_gpus(two_ranks):
    """The Trainer hands Accelerate a tensor-parallel ParallelismConfig for tp_size > 1, which Accelerate takes only
    on GPUs: those layouts are run by examples/trainer_distributed.py there (README, Parallelism)."""
    result = two_ranks("trainer_distributed_config", rank=0)
    assert "ParallelismConfig" in result["tp_on_cpu"] and "MULTI_CPU" in result["tp_on_cpu"]


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
