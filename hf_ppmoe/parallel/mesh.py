"""Process groups and device meshes with timeouts, so a dead or hung rank or a wrong world size gives an error; and
the end of a process that used them (`exit_distributed`).

c10d waits 30 minutes by default (2 hours on a group Transformers creates), and sub-groups of a `DeviceMesh` do not
inherit the world group's timeout, so a rank that stops answering stalls every other rank for that long. Here every
group gets `timeout`: a collective that waits longer raises `RuntimeError` ("Timed out waiting ... ms"), and one whose
peer process died raises at once ("Connection reset by peer" / "Connection closed by peer" on gloo).
"""

from __future__ import annotations

import atexit
import os
import sys
from datetime import timedelta
from typing import NamedTuple, NoReturn

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


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (`gloo_tcp_loop`, `pt_gloo_runloop`: one set per gloo group whose C++
    object is alive); None where threads cannot be listed (no /proc)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(name for name in names if "gloo" in name)


def exit_distributed(code: int = 0) -> NoReturn:
    """End a process that used torch.distributed with exit status `code`, without the interpreter's finalization
    while gloo's threads live: the end for every script that torchrun or `accelerate launch` runs.

    Why: a gloo group runs each collective on a worker thread (`pt_gloo_runloop`) that, after the collective has
    completed, drops its reference to the work and with it to the work's tensors; for a tensor created in Python that
    decref needs the GIL. When the main thread has meanwhile returned from its last collective and begun finalizing
    the interpreter, the worker's GIL request ends the thread (`PyThread_exit_thread`), whose unwind through the
    work's destructor calls std::terminate: "terminate called without an active exception", SIGABRT, a failed rank
    after a finished job (core dump: `~AsyncAllreduceWork` -> `decref_pyobject` -> `take_gil` -> `pthread_exit`). The
    slower the worker thread (a loaded machine), the likelier. `destroy_process_group` only joins those threads when
    it frees the group's last reference, and a DistributedDataParallel model or an FSDP2 mesh keeps one to the end of
    the process (torch 2.13: Accelerate's DDP leaves one group's threads alive, an FSDP2 run five).

    So: the process groups are destroyed, the `atexit` handlers run (logging, trackers), stdout and stderr are
    flushed, and the process ends with `os._exit(code)` before the interpreter finalizes. Where no gloo thread is
    alive (none was started, or all were joined), this is a plain `sys.exit(code)`."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if gloo_threads() == []:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone
            pass
    os._exit(code)


def device_type() -> str:
    """The device the world group communicates on: "cpu" for gloo, the accelerator otherwise."""
    if dist.get_backend() == "gloo" or not torch.accelerator.is_available():
        return "cpu"
    return torch.accelerator.current_accelerator().type


def _options(timeout: timedelta):
    options = dist.ProcessGroupNCCL.Options() if dist.get_backend() == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options


def make_mesh(
    *, dp: int = 1, fsdp: int = 1, pp: int = 1, tp: int = 1, timeout: timedelta = DEFAULT_TIMEOUT
) -> DeviceMesh:
    """A (dp, fsdp, pp, tp) `DeviceMesh` over all ranks, every sub-group with `timeout`. Consecutive ranks share a
    tensor-parallel group (keep it inside a node): 4 ranks, pp=2, tp=2 -> tp groups {0,1} {2,3}, pp groups {0,2}
    {1,3}. `mesh["tp"]` / `mesh["pp"]` are the 1-D meshes to hand to `parallelize` / `Pipeline`; `fsdp` ranks shard
    the parameters, gradients and optimizer state (`fully_shard_model`), `dp` are replicas of those (HSDP when both
    are > 1, with dp outermost: across nodes). `batch_mesh(mesh)` is the group of ranks that read different batches.

    Raises ValueError, before any communication, unless dp * fsdp * pp * tp equals the world size."""
    if not dist.is_initialized():
        raise RuntimeError("Call hf_ppmoe.parallel.init_distributed() (or dist.init_process_group) first.")
    world = dist.get_world_size()
    if min(dp, fsdp, pp, tp) < 1 or dp * fsdp * pp * tp != world:
        raise ValueError(
            f"dp={dp} x fsdp={fsdp} x pp={pp} x tp={tp} = {dp * fsdp * pp * tp} ranks, but this job has {world} "
            f"(WORLD_SIZE). Start it with `torchrun --nproc-per-node {dp * fsdp * pp * tp}`, or choose sizes whose "
            f"product is {world}."
        )
    options = _options(timeout)
    names = ("dp", "fsdp", "pp", "tp")
    return init_device_mesh(
        device_type(), (dp, fsdp, pp, tp), mesh_dim_names=names, backend_override=dict.fromkeys(names, options)
    )


def batch_mesh(mesh: DeviceMesh, timeout: timedelta = DEFAULT_TIMEOUT) -> DeviceMesh:
    """The ranks of a `make_mesh` mesh that read different batches (dp x fsdp, one 1-D mesh): average or sum per-
    replica values over it. Builds a group when both dp and fsdp are > 1: call it on every rank."""
    dp, fsdp = mesh["dp"], mesh["fsdp"]
    if dp.size() == 1 or fsdp.size() == 1:
        return fsdp if dp.size() == 1 else dp
    return mesh["dp", "fsdp"]._flatten("batch", backend_override=_options(timeout))


class ExpertMesh(NamedTuple):
    """Where experts live under expert parallelism wider than tensor parallelism (`expert_mesh`)."""

    ep: DeviceMesh  # the ranks that split every MoE layer's experts between them (tokens travel by all-to-all)
    replicas: DeviceMesh  # the ranks holding the same experts, which FSDP shards: (dp, efsdp), or (efsdp,) if dp == 1


def expert_mesh(mesh: DeviceMesh, ep: int, timeout: timedelta = DEFAULT_TIMEOUT) -> ExpertMesh:
    """The experts' view of a `make_mesh` mesh when ep = k x tp exceeds tp: an "ep" group is k tensor-parallel groups
    of consecutive fsdp ranks (different batches, the same pipeline stage) that together hold every expert once, and
    the fsdp / k groups of such copies ("efsdp") shard them. 8 ranks, fsdp=4, tp=2, ep=4: ep groups {0,1,2,3}
    {4,5,6,7}, efsdp groups {0,4} {1,5} ... Both views share the root mesh, so a DTensor on `ep` can be FSDP-sharded
    on `replicas`.

    Raises ValueError unless tp divides ep and ep / tp divides fsdp."""
    tp, fsdp = mesh["tp"].size(), mesh["fsdp"].size()
    if ep % tp or fsdp % (ep // tp):
        choices = sorted(tp * k for k in range(1, fsdp + 1) if fsdp % k == 0)
        raise ValueError(
            f"ep={ep} must be tp={tp} times a divisor of fsdp={fsdp}: an expert-parallel group is made of whole "
            f"tensor-parallel groups of ranks that shard the same replica. Use ep in {choices}."
        )
    k, options = ep // tp, _options(timeout)
    names = ("efsdp", "ep_fsdp")
    view = mesh._unflatten("fsdp", (fsdp // k, k), names, backend_override=dict.fromkeys(names, options))
    ep_mesh = view["ep_fsdp", "tp"]._flatten("ep", backend_override=options)
    return ExpertMesh(ep_mesh, view["dp", "efsdp"] if mesh["dp"].size() > 1 else view["efsdp"])
