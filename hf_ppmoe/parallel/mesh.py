"""Process groups and device meshes with timeouts, so a dead or hung rank or a wrong world size gives an error.

c10d waits 30 minutes by default (2 hours on a group Transformers creates), and sub-groups of a `DeviceMesh` do not
inherit the world group's timeout, so a rank that stops answering stalls every other rank for that long. Here every
group gets `timeout`: a collective that waits longer raises `RuntimeError` ("Timed out waiting ... ms"), and one whose
peer process died raises at once ("Connection reset by peer" / "Connection closed by peer" on gloo).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DEFAULT_TIMEOUT = timedelta(minutes=5)


def init_distributed(timeout: timedelta = DEFAULT_TIMEOUT, backend: str | None = None) -> None:
    """Join the process group `torchrun` / `accelerate launch` describe in the environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), with `timeout`. Backend: NCCL when CUDA is available, else gloo. No-op when already
    initialized (Transformers' `from_pretrained(distributed_config=...)` then reuses this group)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            "torch.distributed needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment: start the "
            "script with `torchrun --nproc-per-node N script.py` (or `accelerate launch --num_processes N`)."
        )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timeout)


def device_type() -> str:
    """The device the world group communicates on: "cpu" for gloo, the accelerator otherwise."""
    if dist.get_backend() == "gloo" or not torch.accelerator.is_available():
        return "cpu"
    return torch.accelerator.current_accelerator().type


def make_mesh(*, dp: int = 1, pp: int = 1, tp: int = 1, timeout: timedelta = DEFAULT_TIMEOUT) -> DeviceMesh:
    """A (dp, pp, tp) `DeviceMesh` over all ranks, every sub-group with `timeout`. Consecutive ranks share a tensor-
    parallel group (keep it inside a node): 4 ranks, pp=2, tp=2 -> tp groups {0,1} {2,3}, pp groups {0,2} {1,3}.
    `mesh["tp"]` / `mesh["pp"]` / `mesh["dp"]` are the 1-D meshes to hand to `parallelize` / `Pipeline` / your
    data-parallel gradient reduction.

    Raises ValueError, before any communication, unless dp * pp * tp equals the world size."""
    if not dist.is_initialized():
        raise RuntimeError("Call hf_ppmoe.parallel.init_distributed() (or dist.init_process_group) first.")
    world = dist.get_world_size()
    if min(dp, pp, tp) < 1 or dp * pp * tp != world:
        raise ValueError(
            f"dp={dp} x pp={pp} x tp={tp} = {dp * pp * tp} ranks, but this job has {world} (WORLD_SIZE). Start it "
            f"with `torchrun --nproc-per-node {dp * pp * tp}`, or choose sizes whose product is {world}."
        )
    options = dist.ProcessGroupNCCL.Options() if dist.get_backend() == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return init_device_mesh(
        device_type(),
        (dp, pp, tp),
        mesh_dim_names=("dp", "pp", "tp"),
        backend_override={"dp": options, "pp": options, "tp": options},
    )
