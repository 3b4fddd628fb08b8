import pytest
import torch
from converters import build_dense, save_dense


@pytest.fixture(scope="session")
def dense(tmp_path_factory):
    """dense(arch) -> (model, folder): one tiny random model per architecture, saved once per session with a tokenizer."""
    cache = {}

    def get(arch):
        if arch not in cache:
            model = build_dense(arch)
            cache[arch] = (model, save_dense(model, tmp_path_factory.mktemp(arch)))
        return cache[arch]

    return get


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These models are tiny: extra threads only add synchronization, which is slow on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
