"""examples/parallel_train.py (the pipeline loop docs/parallel.md points to) runs: TP x PP on 4 processes, loss decreasing."""

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "parallel_train.py"


def test_pipeline_example_trains():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(EXAMPLE),
               "--pp=2", "--tp=2", "--steps=12", "--batch-size=8", "--block-size=32", "--microbatches=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], result.stdout
