"""One torchrun job per world size runs every multi-process check (worker.py); the tests assert on its results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("worker.py")


class Job:
    def __init__(self, name: str, nprocs: int, tmp_dir: Path, timeout: int = 900):
        out = tmp_dir / name
        out.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PARALLEL_TEST_DIR": str(tmp_dir)}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}"]
        self.process = subprocess.run(
            [*command, str(WORKER), name, str(out)], env=env, capture_output=True, text=True, timeout=timeout
        )
        self.ranks = [
            json.loads(path.read_text()) if path.exists() else {}
            for path in (out / f"rank{r}.json" for r in range(nprocs))
        ]

    def __call__(self, check: str, rank: int | None = None):
        """The results of `check` on every rank (or on `rank`); fails with the worker's traceback if it raised."""
        for r, results in enumerate(self.ranks):
            if check not in results:
                pytest.fail(f"rank {r} recorded no result for {check}; job output:\n{self.process.stderr[-6000:]}")
            if "exception" in results[check]:
                pytest.fail(f"rank {r}, {check}:\n{results[check]['exception']}")
        per_rank = [results[check] for results in self.ranks]
        return per_rank if rank is None else per_rank[rank]


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    return Job("two", 2, tmp_path_factory.mktemp("two_ranks"))


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory):
    return Job("four", 4, tmp_path_factory.mktemp("four_ranks"))
