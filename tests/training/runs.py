"""Several `python -m hf_ppmoe.training` runs in one torchrun launch, one after the other in the same processes
(process start-up is the expensive part):

    python -m torch.distributed.run --nproc-per-node N tests/training/runs.py '[["--flag=value", ...], ...]'

With HF_PPMOE_TEST_STALL_AFTER_STEP=S in the environment, rank 0 stops for good once it has logged step S's training
metrics (the others then wait in their next collective): a job for a test to kill at a known point.
"""

import json
import os
import sys
import time

from accelerate.state import AcceleratorState, GradientState, PartialState

from hf_ppmoe.parallel import exit_distributed
from hf_ppmoe.training.__main__ import cli
from hf_ppmoe.training.tracking import JSONLinesTracker


def stall_after(stop_step: int) -> None:
    log = JSONLinesTracker.log

    def log_then_stall(self, values, step=None, **kwargs):
        log(self, values, step, **kwargs)
        if step == stop_step and "train/lm_loss" in values:
            time.sleep(3600)

    JSONLinesTracker.log = log_then_stall


if __name__ == "__main__":
    if "HF_PPMOE_TEST_STALL_AFTER_STEP" in os.environ:
        stall_after(int(os.environ["HF_PPMOE_TEST_STALL_AFTER_STEP"]))
    # A run ends with Accelerator.end_training, which destroys the process group. A new default group in the same
    # torchrun job would meet the old one's rendezvous keys in torchrun's store (and hang), so the group is kept for
    # the next run, and Accelerate's state is reset around it, as in a new process.
    PartialState.destroy_process_group = lambda self, group=None: None
    for argv in json.loads(sys.argv[1]):
        if cli(argv):
            sys.exit(f"run {argv} failed")
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    # the group kept above is destroyed once, after the last run, and the process ends as `python -m
    # hf_ppmoe.training` does (exit_distributed: gloo's threads would abort the interpreter's finalization)
    exit_distributed(0)
