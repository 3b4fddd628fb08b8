"""Issue 25, hf_ppmoe.utils.atomic: a killed writer's temporary folder is deleted by the next write into the same
parent also while its process number still answers (a zombie not yet reaped, or a number reused by a later process);
also when a helper it forked still holds its lock (issue 31), and one that cannot be deleted is named in a warning;
a writer that reports a full disk without an errno (torch.save's "unexpected pos") gets the clear out-of-space
error, with the earlier folder intact."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import hf_ppmoe.utils.atomic as atomic
from hf_ppmoe.utils.atomic import atomic_folder

# a writer that stops half-way (argv: atomic.py, target)
PAUSED_WRITER = textwrap.dedent(
    """
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("atomic", sys.argv[1])
    atomic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(atomic)
    with atomic.atomic_folder(sys.argv[2]) as staging:
        (staging / "weights").write_text("partial")
        print("writing", flush=True)
        time.sleep(120)
    """
)


def _hidden(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _write(target, text="new"):
    with atomic_folder(target, overwrite=True) as staging:
        (staging / "weights").write_text(text)


def test_a_killed_writer_not_yet_reaped_is_cleaned_by_the_next_write_into_the_parent(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", PAUSED_WRITER, atomic.__file__, str(tmp_path / "a")],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
        [staging] = _hidden(tmp_path)
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, but not reaped: a zombie keeps its number
        _write(tmp_path / "b")  # another target in the same parent
        assert _hidden(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["b"], staging
    finally:
        child.kill()
        child.wait()


def test_a_temporary_folder_named_after_a_reused_process_number_is_cleaned(tmp_path):
    # the writer's number now belongs to a process that started after the folder was last changed
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = tmp_path / f".a.saving-{atomic._HOST}-{later.pid}-0123abcd"
        stale.mkdir()
        (stale / "weights").write_text("partial")
        an_hour_ago = os.stat(stale).st_mtime - 3600
        os.utime(stale, (an_hour_ago, an_hour_ago))
        _write(tmp_path / "b")
        assert not stale.exists()
        # a folder changed after the process started may be its own: left alone
        mine = tmp_path / f".c.saving-{atomic._HOST}-{later.pid}-4567abcd"
        mine.mkdir()
        _write(tmp_path / "b")
        assert mine.exists()
    finally:
        later.kill()
        later.wait()


# torch.save of a 64 KiB tensor into an atomic folder while the kernel refuses file sizes beyond 16 KiB (EFBIG): torch
# reports it as "RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos ...", without an errno
TORCH_SAVE_FULL = textwrap.dedent(
    """
    import resource, signal, sys
    import torch
    from hf_ppmoe.utils.atomic import OutOfSpaceError, atomic_folder
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, resource.RLIM_INFINITY))
    try:
        with atomic_folder(sys.argv[1], overwrite=True) as staging:
            torch.save({"weight": torch.ones(16384)}, staging / "optimizer.bin")
    except OutOfSpaceError as error:
        print(f"OutOfSpaceError errno={error.errno}: {error}; caused by {type(error.__cause__).__name__}: {error.__cause__}")
    """
)


def test_torch_save_into_a_full_disk_gives_the_clear_error_and_keeps_the_earlier_checkpoint(tmp_path):
    target = tmp_path / "step_2"
    _write(target, "earlier")
    result = subprocess.run([sys.executable, "-c", TORCH_SAVE_FULL, str(target)], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert out.startswith("OutOfSpaceError errno=27: [Errno 27] Not enough space to write"), out  # EFBIG
    assert "is unchanged" in out and "unexpected pos" in out, out  # torch's own error is kept as the cause
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]
    assert (target / "weights").read_text() == "earlier"


def test_an_error_that_is_not_a_full_disk_stays_itself(tmp_path):
    try:
        with atomic_folder(tmp_path / "out") as staging:
            (staging / "x").write_text("x")
            raise RuntimeError("unrelated")
    except RuntimeError as error:
        assert not isinstance(error, OSError) and str(error) == "unrelated"
    assert list(tmp_path.iterdir()) == []


# a writer that forks a helper (which inherits the lock on the temporary folder, as a data loader worker would) and
# stops half-way (argv: atomic.py, target); prints the helper's process id
FORKING_WRITER = PAUSED_WRITER.replace(
    '    print("writing", flush=True)',
    '    import os\n    helper = os.fork()\n    if helper == 0:\n        time.sleep(120)\n        os._exit(0)\n'
    '    print(helper, flush=True)',
)


def test_a_killed_writer_whose_forked_helper_holds_the_lock_is_cleaned_by_the_next_write(tmp_path):
    """Issue 31: save_pretrained killed while writing a new folder left `.NAME.saving-...` behind for good."""
    writer = subprocess.Popen([sys.executable, "-c", FORKING_WRITER, atomic.__file__, str(tmp_path / "new")],
                              stdout=subprocess.PIPE, text=True)
    helper = int(writer.stdout.readline())
    try:
        writer.kill()
        writer.wait()
        assert len(_hidden(tmp_path)) == 1  # the killed save's folder, its lock still held by the helper
        _write(tmp_path / "other")  # the next write into the parent
        assert _hidden(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["other"]
    finally:
        os.kill(helper, signal.SIGKILL)


def test_a_stale_folder_that_cannot_be_deleted_is_named_in_a_warning(tmp_path, monkeypatch):
    stale = tmp_path / f".new.saving-{atomic._HOST}-{2**22 + 7}-0123abcd"  # above pid_max's default: no such process
    stale.mkdir()

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(atomic.shutil, "rmtree", refuse)
    with pytest.warns(UserWarning, match=rf"{stale.name} is left over from a write whose process .* delete it by hand"):
        atomic.recover(tmp_path)
    assert stale.exists()
