"""Several `python -m hf_ppmoe.training` runs in one torchrun launch, one after the other in the same processes
(process start-up is the expensive part):

    python -m torch.distributed.run --nproc-per-node N tests/training/runs.py '[["--flag=value", ...], ...]'
"""

import json
import sys

from accelerate.state import AcceleratorState, GradientState

from hf_ppmoe.training.__main__ import cli

if __name__ == "__main__":
    for argv in json.loads(sys.argv[1]):
        if cli(argv):
            sys.exit(f"run {argv} failed")
        # a run ends with Accelerator.end_training, which destroys the process group: let the next run's
        # Accelerator start afresh, as in a new process (what Accelerate's own test cases do between tests)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
