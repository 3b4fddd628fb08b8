"""Run by test_exit.py under torchrun (2 gloo processes): a DDP model (whose gloo group outlives the model and
destroy_process_group) trained one step, an atexit handler that writes DIR/atexit_<rank>, then
`exit_distributed(CODE)`; DIR/threads_<rank> records the gloo threads alive before it."""

import atexit
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hf_ppmoe.parallel import exit_distributed, init_distributed
from hf_ppmoe.parallel.mesh import gloo_threads

if __name__ == "__main__":
    folder, code = Path(sys.argv[1]), int(sys.argv[2])
    init_distributed()
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    del model
    atexit.register(lambda: (folder / f"atexit_{rank}").write_text("ran"))
    (folder / f"threads_{rank}").write_text(" ".join(gloo_threads()))
    exit_distributed(code)
