"""Other engines on our models, 2 processes (gloo), against one process; every test body runs on both ranks
(tests/distributed.py).

- Transformers' `Trainer` on models sharded at load time by `DistributedConfig` (examples/trainer_distributed.py):
  what runs on CPU; a tensor-parallel layout needs GPUs (Accelerate refuses its ParallelismConfig on CPU).
- DeepSpeed ZeRO-3 through Accelerate (DeepSpeed's CPU accelerator on gloo).
"""

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import tmp_dir
from equivalence import GATES, SEQ2SEQ_GATES, batch, build, max_diff, save_checkpoint

from hf_ppmoe import GPTMoEForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # the Trainer tests run the example's code

pytestmark = pytest.mark.distributed(2)

# AdamW divides each update by the running gradient scale, so parameters whose gradients are tiny take float-noise
# differences of the gradients into their updates at full learning rate: parameters after a few AdamW steps are
# compared at this tolerance (losses at 1e-5, as elsewhere).
ADAM_ATOL = 5e-5


@contextlib.contextmanager
def accelerate_session():
    """Accelerate keeps process-wide state (its AcceleratorState, environment variables it sets, Transformers'
    DeepSpeed config): every test that uses it starts and leaves it clean (the processes run several tests)."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    environment = dict(os.environ)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(environment)


@pytest.mark.parametrize("run", ["gpt/fsdp2_ep2_all_to_all", "seq2seq/fsdp2"])
def test_trainer_with_distributed_config_equals_one_process(run):
    """GPT-MoE: FSDP2 x all-to-all expert parallelism over the FSDP ranks, 2 gradient accumulation steps;
    Seq2Seq-MoE: FSDP2. Per-step losses and the parameters after training = one process accumulating the same
    micro-batches (clipping, AdamW)."""
    from trainer_distributed import compare
    from transformers import DistributedConfig

    family, layout, accumulation = {
        "gpt/fsdp2_ep2_all_to_all": ("gpt", dict(fsdp_size=2, ep_size=2, ep_implementation="all_to_all"), 2),
        "seq2seq/fsdp2": ("seq2seq", dict(fsdp_size=2), 1),
    }[run]
    with accelerate_session():
        result = compare(family, DistributedConfig(**layout), accumulation=accumulation, output_dir=str(tmp_dir()))
    assert len(result["losses"]) == len(result["ref_losses"]) == 2
    assert result["loss_diff"] < 1e-5
    assert result["param_diff"] < ADAM_ATOL


def test_trainer_with_tensor_parallelism_needs_gpus():
    """The Trainer hands Accelerate a tensor-parallel ParallelismConfig for tp_size > 1, which Accelerate takes only
    on GPUs: those layouts are run by examples/trainer_distributed.py there (docs/parallel.md)."""
    from trainer_distributed import build as build_example
    from transformers import DistributedConfig, Trainer, TrainingArguments

    path = tmp_dir() / "initial_gpt"
    if dist.get_rank() == 0:
        build_example("gpt").save_pretrained(path)
    dist.barrier()
    with accelerate_session():
        model = GPTMoEForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))
        args = TrainingArguments(output_dir=str(tmp_dir()), report_to=[], use_cpu=True)
        with pytest.raises(ValueError, match="ParallelismConfig") as error:
            Trainer(model=model, args=args)
    assert "MULTI_CPU" in str(error.value)


@pytest.mark.parametrize("family", ["gpt", "seq2seq"])
def test_deepspeed_zero3_equals_one_process(family):
    """DeepSpeed ZeRO-3 through Accelerate (gloo, CPU), plain loop, each rank on its half of every batch = one process
    accumulating both halves, through three AdamW steps with clipping. ZeRO-3 gathers a module's parameters for its
    backward through hooks on the tensors of its output; the gates' `Routing` is a NamedTuple so that DeepSpeed finds
    them (a dataclass hid them: "The size of tensor a (0) must match the size of tensor b (H)" in the router's
    backward). GPT-MoE is loaded under ZeRO-3's partitioned init (`from_pretrained` while the DeepSpeed config is
    active, as the Trainer does), Seq2Seq-MoE built in memory."""
    deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed, or the test extra)")
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    # the CPU backend's shared-memory collectives are a C++ extension compiled on first use (minutes on 2 cores)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    seq2seq, rank = family == "seq2seq", dist.get_rank()
    settings = SEQ2SEQ_GATES["prototype_capacity"] if seq2seq else GATES["topk_capacity_shared"]
    ref = build(seq2seq=seq2seq, **settings)
    path = tmp_dir() / "checkpoint"
    save_checkpoint(settings, path, seq2seq)
    with accelerate_session():
        zero3 = {"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0,
                 "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * dist.get_world_size()}
        # backend: Accelerate counts the processes of a CPU DeepSpeed job only when it is named
        accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=zero3),
            kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
        )
        model = build(seq2seq=True, **settings) if seq2seq else GPTMoEForCausalLM.from_pretrained(path).train()
        numel_at_load = sum(p.numel() for p in model.parameters())
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(3):
            halves = [tuple(t[i : i + 2] for t in batch(seed=step + 1, seq2seq=seq2seq)) for i in (0, 2)]
            ref_losses = []
            for ids, mask, labels in halves:
                loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
                (loss / 2).backward()
                ref_losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            ids, mask, labels = halves[rank]
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            assert loss.item() == pytest.approx(ref_losses[rank], abs=1e-5), f"step {step}"
        inner = accelerator.unwrap_model(model)
        with deepspeed.zero.GatheredParameters(list(inner.parameters())):
            params_after = max_diff(inner, ref, what="param")
        assert accelerator.num_processes == 2
    assert params_after < ADAM_ATOL
    if family == "gpt":
        assert numel_at_load == 0  # every parameter partitioned at load
