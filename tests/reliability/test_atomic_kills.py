"""hf_ppmoe.utils.atomic under real kills: a child process replaces a folder and is killed by a real SIGKILL or
SIGTERM at a named step of the write; the folder must then hold the complete old or the complete new contents, and
the next write (or `recover`) must leave nothing of the killed one behind.

The child loads only hf_ppmoe/utils/atomic.py (standard library), so each kill costs a bare Python start-up. The
saves, conversions and checkpoints that use it are killed the same way in test_atomic_saves.py.
"""

import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import hf_ppmoe.utils.atomic as atomic
from hf_ppmoe.utils.atomic import atomic_folder, recover

ATOMIC_PY = atomic.__file__

# argv: atomic.py, target, step, signal name, "exchange" | "rename" (renameat2 disabled: the two-rename path)
CHILD = textwrap.dedent(
    """
    import importlib.util, os, resource, signal, sys, time
    spec = importlib.util.spec_from_file_location("atomic", sys.argv[1])
    atomic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(atomic)
    target, step, sig, mode = sys.argv[2:6]

    def die():
        os.kill(os.getpid(), getattr(signal, sig))
        time.sleep(60)  # a signal the process survived would show as a timeout

    if mode == "rename":
        atomic._exchange = lambda a, b: False
    if step == "staged":  # everything written and flushed, nothing renamed yet
        fsync_tree = atomic._fsync_tree
        atomic._fsync_tree = lambda root: (fsync_tree(root), die())
    rename, rmtree = os.rename, atomic.shutil.rmtree
    def rename_then(src, dst):
        rename(src, dst)
        if step == "aside" and ".replaced-" in str(dst):  # the old folder moved aside, the new one not yet in place
            die()
    def rmtree_then(path, *args, **kwargs):
        if step == "swapped":  # the new folder in place, the old one not yet deleted
            die()
        rmtree(path, *args, **kwargs)
    atomic.os.rename, atomic.shutil.rmtree = rename_then, rmtree_then
    if step == "full":  # a file size limit: the kernel refuses writes beyond 4 KiB (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))

    try:
        with atomic.atomic_folder(target, overwrite=True) as staging:
            (staging / "weights").write_text("new" * (2000 if step == "full" else 1))
            if step == "writing":
                die()
            if step == "pause":
                print("writing", flush=True)
                time.sleep(60)
            (staging / "config").write_text("new")
    except atomic.OutOfSpaceError as error:
        print("OutOfSpaceError:", error)
        sys.exit(0)
    """
)


def _write_old(target: Path) -> None:
    with atomic_folder(target, overwrite=True) as staging:
        (staging / "weights").write_text("old")
        (staging / "config").write_text("old")


def _contents(target: Path) -> dict:
    return {p.name: p.read_text() for p in target.iterdir()} if target.is_dir() else {}


def _child(target, step, sig="SIGKILL", mode="exchange", **kwargs):
    return subprocess.run(
        [sys.executable, "-c", CHILD, ATOMIC_PY, str(target), step, sig, mode],
        capture_output=True, text=True, timeout=30, **kwargs,
    )


STEPS = [  # (step, mode, what the folder holds after the kill)
    ("writing", "exchange", "old"),
    ("staged", "exchange", "old"),
    ("swapped", "exchange", "new"),
    ("writing", "rename", "old"),
    ("aside", "rename", "old"),  # restored by the next write (or recover)
    ("swapped", "rename", "new"),
]


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("step,mode,expected", STEPS, ids=[f"{s}-{m}" for s, m, _ in STEPS])
def test_killed_replacement_leaves_old_or_new_and_the_next_write_cleans_up(tmp_path, step, mode, expected, sig):
    target = tmp_path / "out"
    _write_old(target)
    result = _child(target, step, sig, mode)
    assert result.returncode == -getattr(signal, sig), result.stderr  # really killed by that signal
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "out"]
    if sig == "SIGTERM" and step != "swapped":  # handled as SIGINT: the write cleans up, then the process dies
        assert leftovers == [] and _contents(target) == {"weights": "old", "config": "old"}, leftovers
        return
    # SIGKILL (and, here, the test's second SIGTERM inside the clean-up's rmtree) leaves the temporary folder
    assert leftovers, "a kill in the middle of a write leaves its temporary folder"  # (what the next write removes)
    if step == "aside":
        assert not target.exists()  # the one state the two-rename path can leave: only the aside folder
    else:
        assert _contents(target) == {"weights": expected, "config": expected}

    done = recover(tmp_path)  # what the next write does first
    assert len(done) == len(leftovers)
    assert any(line.startswith(f"restored {target} from .out.replaced-") for line in done) == (step == "aside")
    assert _contents(target) == {"weights": expected, "config": expected}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with atomic_folder(target, overwrite=True) as staging:
        (staging / "weights").write_text("next")
    assert _contents(target) == {"weights": "next"} and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_live_writer_is_left_alone_and_cleaned_up_once_killed(tmp_path):
    target = tmp_path / "out"
    _write_old(target)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, ATOMIC_PY, str(target), "pause", "SIGKILL", "exchange"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout.readline().strip() == "writing"
        staging = [p for p in tmp_path.iterdir() if ".saving-" in p.name]
        assert len(staging) == 1 and f"-{child.pid}-" in staging[0].name
        assert recover(tmp_path) == [] and staging[0].exists()  # its writer holds the lock: not abandoned
        # another process (not the writer's pid) sees the lock too
        check = subprocess.run(
            [sys.executable, "-c", f"import importlib.util as u; s = u.spec_from_file_location('a', {ATOMIC_PY!r}); "
             f"m = u.module_from_spec(s); s.loader.exec_module(m); print(m.recover({str(tmp_path)!r}))"],
            capture_output=True, text=True, timeout=30,
        )
        assert check.stdout.strip() == "[]" and staging[0].exists()
    finally:
        child.kill()
        child.wait()
    assert recover(tmp_path) == [f"deleted {staging[0].name}"]
    assert _contents(target) == {"weights": "old", "config": "old"}


def test_full_disk_raises_a_clear_error_and_leaves_nothing_behind(tmp_path):
    target = tmp_path / "out"
    _write_old(target)
    result = _child(target, "full")
    assert result.returncode == 0, result.stderr
    assert "Not enough space to write" in result.stdout and "is unchanged" in result.stdout, result.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert _contents(target) == {"weights": "old", "config": "old"}


def test_a_new_folder_and_refusals(tmp_path):
    target = tmp_path / "new" / "out"
    with atomic_folder(target) as staging:
        (staging / "a").write_text("1")
    assert _contents(target) == {"a": "1"}
    with pytest.raises(FileExistsError, match="already exists"):
        with atomic_folder(target):
            pass
    with pytest.raises(RuntimeError):  # an error inside the block: nothing changes, nothing stays behind
        with atomic_folder(target, overwrite=True) as staging:
            (staging / "b").write_text("2")
            raise RuntimeError
    assert _contents(target) == {"a": "1"} and [p.name for p in target.parent.iterdir()] == ["out"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        with atomic_folder(tmp_path / "file", overwrite=True):
            pass


def test_kept_entries_and_the_working_directory_follow_the_new_folder(tmp_path, monkeypatch):
    target = tmp_path / "out"
    with atomic_folder(target) as staging:
        (staging / "weights").write_text("old")
        (staging / "logs").mkdir()
        (staging / "logs" / "metrics.jsonl").write_text("line\n")
        (staging / "tokenizer.json").write_text("{}")
    monkeypatch.chdir(target / "logs")
    with atomic_folder(target, overwrite=True, keep=lambda entry: entry.name != "weights") as staging:
        (staging / "config").write_text("new")
    assert _contents(target / "logs") == {"metrics.jsonl": "line\n"}
    assert {p.name for p in target.iterdir()} == {"config", "logs", "tokenizer.json"}
    assert Path.cwd() == (target / "logs").resolve() and Path("metrics.jsonl").read_text() == "line\n"
