"""Training runs in one torchrun launch that are expected to succeed or to fail with a given message, one after the
other in the same processes (process start-up is the expensive part):

    python -m torch.distributed.run --nproc-per-node N tests/reliability/training_runs.py '[{"argv": [...],
        "error": "expected message" | null, "seed_offset_by_rank": false}, ...]'

"{rank}" in an argument becomes the process's rank (processes started with different arguments);
"seed_offset_by_rank" makes each process seed its initialisation with --seed + rank (different weights from the
same arguments). Exits non-zero naming the first run that did not end as expected.
"""

import json
import os
import sys

import accelerate.utils
from accelerate.state import AcceleratorState, GradientState, PartialState

import hf_ppmoe.training.train as train
from hf_ppmoe.parallel import exit_distributed
from hf_ppmoe.training import TrainArguments
from transformers import HfArgumentParser

if __name__ == "__main__":
    # keep the process group between runs (see tests/training/runs.py)
    PartialState.destroy_process_group = lambda self, group=None: None
    rank = int(os.environ["RANK"])
    for run in json.loads(sys.argv[1]):
        argv = [a.replace("{rank}", str(rank)) for a in run["argv"]]
        offset = rank if run.get("seed_offset_by_rank") else 0
        train.set_seed = lambda seed, offset=offset: accelerate.utils.set_seed(seed + offset)
        (args,) = HfArgumentParser(TrainArguments).parse_args_into_dataclasses(argv)
        try:
            train.main(args)
            error = None
        except ValueError as raised:
            error = str(raised)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        expected = run.get("error")
        if (expected is None) != (error is None) or (expected is not None and expected not in error):
            sys.exit(f"rank {rank}: run {argv} expected error {expected!r}, got {error!r}")
    # the group kept above is destroyed once, after the last run, and the process ends (see tests/training/runs.py)
    exit_distributed(0)
