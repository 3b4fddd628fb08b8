"""Two data-parallel Trainer runs in one torchrun launch (gloo, CPU), for test_trainer.py:

    python -m torch.distributed.run --nproc-per-node 2 tests/training/trainer_dp.py DIR

DIR holds `init/` (the model) and `data.pt` (4 rows); rank 0 writes DIR/<run>.pt: the parameters after one SGD step
and the training log entry. Each row is one router group, as in the one-process reference.
"""

import sys
from pathlib import Path

import torch

from hf_ppmoe import GPTMoEForCausalLM
from hf_ppmoe.parallel import exit_distributed
from hf_ppmoe.training import MoETrainer
from test_trainer import one_step

if __name__ == "__main__":
    work = Path(sys.argv[1])
    data = torch.load(work / "data.pt")
    model = GPTMoEForCausalLM.from_pretrained(work / "init")
    runs = {"dp2": dict(per_device_train_batch_size=2), "dp2_accumulate2": dict(per_device_train_batch_size=1, gradient_accumulation_steps=2)}
    for name, overrides in runs.items():
        trained, log = one_step(model, data, work / name, **overrides)
        if torch.distributed.get_rank() == 0:
            torch.save({"state_dict": trained.state_dict(), "log": log}, work / f"{name}.pt")
    # Trainer's DDP keeps its gloo group's threads alive to the end of the process; finalizing the interpreter while
    # one of them releases a collective's tensors aborts the rank ("terminate called without an active exception"):
    # the end every torchrun script of ours takes (hf_ppmoe.parallel.exit_distributed says why)
    exit_distributed(0)
