"""Multi-process tests whose bodies hold their own asserts: `@pytest.mark.distributed(world_size)`.

    @pytest.mark.distributed(2)
    @pytest.mark.parametrize("gate", GATES)
    def test_tp_equals_one_process(gate):   # runs on every rank of a 2-process gloo group
        ...
        assert loss_diff < 1e-5, gate

Process start-up is the expensive part, so the first marked test to run starts one launch (torch.multiprocessing,
spawn; gloo; OMP_NUM_THREADS=1) for every selected test of its world size (and `group`, for tests that patch their
processes, e.g. megatron-core's CPU patches), across test files; each process runs them in collection order. Each
test starts on all ranks together (a barrier) and reports its own outcome: a rank's exception is raised again in the
parent with the rank's traceback (the assert line, pytest's assert explanation), `pytest.skip` skips. A rank that
fails leaves the launch (its peers' next collective then fails fast); the tests after the failed one run in a new
launch, so one failure is reported once.

A marked test takes only its parametrize arguments (no fixtures): `tmp_dir()` gives a folder that is the same on
every rank of the test. A test body that raises SystemExit on a rank ends that rank's part of the launch (a dead
peer; the test passes on that rank, and the tests after it run in a new launch): mark it `last=True` to run it after
the others of its launch.
"""

from __future__ import annotations

import ast
import os
import pickle
import queue
import re
import socket
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest

LAUNCH_TIMEOUT = 900  # seconds for all the tests of one launch
GROUP_TIMEOUT = timedelta(seconds=60)  # a collective whose peer never comes fails after this


def tmp_dir() -> Path:
    """A folder for the running test, the same path on every rank (made on first use)."""
    path = Path(os.environ["DISTRIBUTED_TEST_DIR"], os.environ["DISTRIBUTED_TEST_NAME"])
    path.mkdir(parents=True, exist_ok=True)
    return path


class RemoteTraceback(Exception):
    """The traceback of the rank where a test failed (the `__cause__` of the exception raised again)."""

    def __str__(self):
        return self.args[0]


@dataclass
class Case:
    nodeid: str
    module: str
    path: str
    function: str
    params: dict


@dataclass
class Outcome:
    failures: dict = field(default_factory=dict)  # rank -> (time, pickled exception or None, message, traceback)
    passed: set = field(default_factory=set)  # ranks


# ---------------------------------------------------------------------------------------------- pytest hooks


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "distributed(world_size, group=None, last=False): run the test's body on every rank of a gloo "
        "group (see tests/distributed.py)"
    )


def pytest_collection_modifyitems(items):
    for item in items:
        marker = item.get_closest_marker("distributed")
        if marker is None:
            continue
        extra = set(item.fixturenames) - set(getattr(getattr(item, "callspec", None), "params", {})) - {"_seed"}
        if extra:
            raise pytest.UsageError(
                f"{item.nodeid}: a @pytest.mark.distributed test runs in other processes and takes only its "
                f"parametrize arguments, not the fixtures {sorted(extra)}; use distributed.tmp_dir() for a folder"
            )


_outcomes: dict[str, Outcome] = {}


def pytest_pyfunc_call(pyfuncitem):
    marker = pyfuncitem.get_closest_marker("distributed")
    if marker is None:
        return None
    __tracebackhide__ = True  # the failure shows the rank's traceback, not this hook's
    if pyfuncitem.nodeid not in _outcomes:
        key = _key(pyfuncitem)
        batch = [item for item in pyfuncitem.session.items if _key(item) == key and item.nodeid not in _outcomes
                 and not _skipped(item)]
        if pyfuncitem not in batch:
            batch.insert(0, pyfuncitem)
        batch.sort(key=lambda item: item.get_closest_marker("distributed").kwargs.get("last", False))
        _outcomes.update(run([_case(item) for item in batch], world_size=key[0]))
    raise_failure(_outcomes[pyfuncitem.nodeid], world_size=_key(pyfuncitem)[0])
    return True


def _key(item):
    marker = item.get_closest_marker("distributed")
    if marker is None:
        return None
    world_size = marker.args[0] if marker.args else marker.kwargs["world_size"]
    return world_size, marker.kwargs.get("group")


def _skipped(item) -> bool:
    """Statically skipped (skip, or skipif on a true condition): such tests join no launch."""
    if item.get_closest_marker("skip") is not None:
        return True
    return any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))


def _case(item) -> Case:
    params = dict(getattr(getattr(item, "callspec", None), "params", {}))
    return Case(item.nodeid, item.module.__name__, str(item.path), item.originalname, params)


def raise_failure(outcome: Outcome, world_size: int) -> None:
    """Raise the exception of the rank that failed first, its traceback as the cause (nothing if none failed)."""
    __tracebackhide__ = True
    if not outcome.failures:
        return
    rank, (_, blob, message, text) = min(outcome.failures.items(), key=lambda kv: kv[1][0])  # the first to fail
    others = "".join(
        f"\n\nrank {r} also failed:\n{t}" for r, (_, _, _, t) in sorted(outcome.failures.items()) if r != rank
    )
    try:
        error = pickle.loads(blob) if blob is not None else RuntimeError(message)
    except Exception:  # noqa: BLE001  (an exception type that does not come back through pickle)
        error = RuntimeError(message)
    if isinstance(error, pytest.skip.Exception):
        pytest.skip(str(error.msg))
    error.__cause__ = RemoteTraceback(f"rank {rank} of {world_size}:\n{text}{others}")
    raise error


# ---------------------------------------------------------------------------------------------- launching


def run(tests: list[Case], world_size: int, timeout: float = LAUNCH_TIMEOUT) -> dict[str, Outcome]:
    """Run `tests` on `world_size` processes; {nodeid: Outcome}. After a failure the tests that follow it run again
    in a new launch (what they did after a rank left is not theirs to answer for)."""
    import torch.multiprocessing as mp

    outcomes: dict[str, Outcome] = {}
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="distributed_tests_") as root:
        while tests:
            context = mp.get_context("spawn")
            results = context.Queue()
            port = _free_port()
            processes = [
                context.Process(target=_worker, args=(rank, world_size, port, tests, results, root), daemon=True)
                for rank in range(world_size)
            ]
            for process in processes:
                process.start()
            launch = {test.nodeid: Outcome() for test in tests}
            running = {}  # rank -> index of its test
            left = len(tests)  # the first test after which a rank left the launch on purpose
            while any(p.is_alive() for p in processes) or not results.empty():
                try:
                    kind, index, rank, payload = results.get(timeout=1)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        for process in processes:
                            process.kill()
                        for rank, index in running.items():
                            launch[tests[index].nodeid].failures[rank] = (
                                time.time(), None, f"timed out after {timeout} s", "timed out, processes killed\n"
                            )
                        break
                    continue
                if kind == "start":
                    running[rank] = index
                elif kind in ("pass", "left"):
                    launch[tests[index].nodeid].passed.add(rank)
                    left = min(left, index) if kind == "left" else left
                else:
                    launch[tests[index].nodeid].failures[rank] = payload
            for process in processes:
                process.join()
            for rank, process in enumerate(processes):  # died without reporting its test (a crash, os._exit)
                index = running.get(rank, 0 if process.exitcode else None)
                outcome = launch[tests[index].nodeid] if index is not None else None
                if outcome is not None and rank not in outcome.passed and rank not in outcome.failures:
                    outcome.failures[rank] = (
                        time.time(), None, f"rank {rank} exited with code {process.exitcode}",
                        f"the process exited with code {process.exitcode} during this test (output above)\n",
                    )
            failed = [i for i, test in enumerate(tests) if launch[test.nodeid].failures]
            first = min(failed, key=lambda i: min(t for t, *_ in launch[tests[i].nodeid].failures.values()),
                        default=None)
            done = min(len(tests) if first is None else first + 1, left + 1)
            for test in tests[:done]:
                outcome = launch[test.nodeid]
                missing = set(range(world_size)) - outcome.passed - set(outcome.failures)
                for rank in missing:
                    outcome.failures[rank] = (time.time(), None, "not run", f"rank {rank} never ran this test\n")
                outcomes[test.nodeid] = outcome
            if time.monotonic() > deadline:
                for test in tests[done:]:
                    outcomes[test.nodeid] = Outcome({0: (time.time(), None, "not run: launch timed out", "")})
                break
            tests = tests[done:]
    return outcomes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, tests, results, root):
    """One rank: join the gloo group as torchrun would, run every test, report each; leave at the first failure."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", DISTRIBUTED_TEST_DIR=root,
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
    for index, test in enumerate(tests):
        results.put(("start", index, rank, None))
        os.environ["DISTRIBUTED_TEST_NAME"] = re.sub(r"[^\w.-]+", "_", test.nodeid.rsplit("/", 1)[-1])
        try:
            body = getattr(_import(test.module, test.path), test.function)
            dist.barrier()  # every test starts on all ranks together (some set collective timeouts of seconds)
            torch.manual_seed(0)  # as tests/conftest.py's autouse fixture
            body(**test.params)
        except SystemExit:  # this rank leaves the launch on purpose (a test of a dead peer): the tests after it
            results.put(("left", index, rank, None))  # run in a new launch
            break
        except BaseException as e:  # noqa: BLE001  (pytest.skip / pytest.fail raise BaseExceptions)
            try:
                blob = pickle.dumps(e)
            except Exception:  # noqa: BLE001
                blob = None
            message = f"{type(e).__name__}: {e}"
            results.put(("fail", index, rank, (time.time(), blob, message, traceback.format_exc())))
            break
        results.put(("pass", index, rank, None))
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown: a peer may be gone, and gloo's threads must not be joined then


def _import(name: str, path: str) -> types.ModuleType:
    """The test module, its asserts rewritten as pytest does (so a failure explains its values)."""
    if name in sys.modules:
        return sys.modules[name]
    from _pytest.assertion.rewrite import rewrite_asserts

    source = Path(path).read_bytes()
    tree = ast.parse(source, filename=path)
    rewrite_asserts(tree, source, path)
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    exec(compile(tree, path, "exec", dont_inherit=True), module.__dict__)
    return module
