"""tests/gpu: run with `python -m pytest -q tests/gpu` on a CUDA machine (`scripts/gpu_check.sh` runs them with the
carried wheels and a report); skipped, with the reason, everywhere else. Each test gets GPU_TEST_TIMEOUT seconds
(default 120; 0: none): a SIGALRM fails the test that hangs instead of the whole lent machine's time."""

import os
import signal

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_reference: a tests/gpu test that runs on CPU too (no CUDA needed)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu compares CUDA against the CPU float64 reference)")
    for item in items:
        in_gpu = "tests/gpu/" in str(item.fspath).replace("\\", "/")
        runs_on_cpu = item.get_closest_marker("cpu_reference") or item.name.startswith("test_the_comparison")
        if in_gpu and not runs_on_cpu:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def per_test_timeout(request):
    seconds = int(os.environ.get("GPU_TEST_TIMEOUT", "120"))
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expired(signum, frame):
        raise TimeoutError(f"{request.node.nodeid} ran past GPU_TEST_TIMEOUT={seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
