"""tests/gpu: run with `python -m pytest -q tests/gpu` on a CUDA machine (scripts/build_gpu_wheels.sh brings what a
machine without network needs); skipped, with the reason, everywhere else."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu compares CUDA against the CPU float32 reference)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
