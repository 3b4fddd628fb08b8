import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Decoding tiny models is a long chain of small ops: one thread avoids per-op sync on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
