"""`exit_distributed` (hf_ppmoe.parallel.mesh): a torchrun process whose gloo group DDP keeps alive ends with the exit
status it is given and its atexit handlers run, without finalizing the interpreter while gloo's threads live (the
finalization could abort the rank with "terminate called without an active exception": mesh.py says why)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("exit_worker.py")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through /proc")
def test_exit_distributed_keeps_the_status_and_runs_atexit_handlers(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
               str(tmp_path), "3"]
    job = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert "terminate called" not in job.stderr
    assert job.returncode != 0 and "exitcode  : 3" in job.stderr, job.stderr[-3000:]  # torchrun reports each rank's
    for rank in (0, 1):
        assert (tmp_path / f"atexit_{rank}").read_text() == "ran"
        assert "pt_gloo_runloop" in (tmp_path / f"threads_{rank}").read_text()  # what exit_distributed is for
