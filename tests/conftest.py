import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# @pytest.mark.distributed(world_size): multi-process tests whose bodies run on every rank (tests/distributed.py)
from distributed import pytest_collection_modifyitems, pytest_configure, pytest_pyfunc_call  # noqa: E402, F401
