"""Several `python -m hf_ppmoe.training` runs in one torchrun launch, one after the other in the same processes
(process start-up is the expensive part):

    python -m torch.distributed.run --nproc-per-node N tests/training/runs.py '[["--flag=value", ...], ...]'
"""

import json
import sys

from accelerate.state import AcceleratorState, GradientState, PartialState

from hf_ppmoe.training.__main__ import cli

if __name__ == "__main__":
    # A run ends with Accelerator.end_training, which destroys the process group. A new default group in the same
    # torchrun job would meet the old one's rendezvous keys in torchrun's store (and hang), so the group is kept for
    # the next run, and Accelerate's state is reset around it, as in a new process.
    PartialState.destroy_process_group = lambda self, group=None: None
    for argv in json.loads(sys.argv[1]):
        if cli(argv):
            sys.exit(f"run {argv} failed")
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
