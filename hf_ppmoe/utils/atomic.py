"""All-or-nothing folder writes: a folder is written under a temporary name beside its target and takes the target's
place only once complete and flushed to disk, so a process killed at any moment leaves either the complete old folder
or the complete new one.

    with atomic_folder("out", overwrite=True) as staging:    # writes go to .out.saving-HOST-PID-TOKEN
        write_everything(staging)                             # an error, or a kill, leaves "out" as it was
    # here the files are fsynced and "out" has been replaced in one step

Replacing an existing folder is one atomic exchange of the two names where the system has it (Linux `renameat2`
with RENAME_EXCHANGE: ext4, xfs, btrfs, tmpfs, ...); the old contents, now under the temporary name, are then
deleted. Elsewhere it takes two renames: the old folder moves aside (.out.replaced-HOST-PID-TOKEN), the new one
moves into place, the old one is deleted; a kill between the two renames leaves only the aside folder.

Leftovers of writers that were killed repair themselves: every atomic write, and `recover`, looks at the temporary
folders in its target's parent, and for each whose writer is gone deletes it, or moves an aside folder whose target
is missing back into place. A writer holds an exclusive `flock` on its temporary folders while it lives (the kernel
drops it when the process dies, however it dies), and a temporary folder counts as abandoned when, on this host, the
process named in it is gone: it no longer exists, is a zombie (killed and not yet reaped by its parent), or started
after the folder was last changed (its number was reused by a later process); the lock may then still be held by a
process the writer forked (which inherits it), and is ignored. A folder of another host counts as abandoned only when
its lock is free. An abandoned folder that cannot be deleted is named in a warning.

SIGTERM (what `timeout`, `kill` and job schedulers send) is handled like SIGINT while a write runs in the main
thread: the write stops, its temporary folder is deleted (or an old folder moved aside is put back), and the process
then dies by SIGTERM as it would have; a program's own SIGTERM handler is left alone. SIGKILL leaves the temporary
folder to the next write, as above.

A write that fails for lack of space raises `OutOfSpaceError` (an OSError with errno ENOSPC, EDQUOT or EFBIG), also
when the writer reported it without an errno (torch.save: "enforce fail at inline_container.cc ... unexpected pos"):
after any other OSError or RuntimeError, a 1 MiB write into the temporary folder shows whether the disk is full.

Only the standard library is used: the model code carries this module into checkpoints for `trust_remote_code`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import signal
import socket
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; the process id in the name decides
    fcntl = None

_HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "localhost"
# .NAME.saving-HOST-PID-TOKEN (a folder being written) and .NAME.replaced-HOST-PID-TOKEN (an old one moved aside)
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<kind>saving|replaced)-(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-[0-9a-f]{8}$")
_OUT_OF_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class Terminated(BaseException):
    """SIGTERM arrived while an atomic write ran (raised in the main thread, as Ctrl-C raises KeyboardInterrupt)."""


def _raise_terminated(signum, frame):
    raise Terminated(f"signal {signum} (SIGTERM)")


def _sigterm_as_interrupt() -> bool:
    """While a write runs, SIGTERM (what `timeout`, `kill` and job schedulers send) raises `Terminated` in the main
    thread as SIGINT raises KeyboardInterrupt, so the temporary folder is deleted on the way out. Installed only in
    the main thread and where SIGTERM has its default action (a program's own handler, or an outer write's, is left
    alone); returns whether it was installed here."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _raise_terminated)
    return True


class OutOfSpaceError(OSError):
    """A write ran out of disk space (or into a file size limit); nothing was changed."""


class _Lock:
    """An exclusive flock on a folder, released by `close` or by the death of the process."""

    def __init__(self, path: Path):
        self.fd = None
        if fcntl is None:
            return
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise
        except OSError:  # a filesystem without flock: the name's host and process id speak for the writer
            os.close(fd)
            return
        self.fd = fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _temporary(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")


def _writer_alive(pid: int, changed: float) -> bool:
    """Whether process `pid` of this host may be the writer of a temporary folder last changed at `changed` (a
    timestamp): it exists, is no zombie, and started before that change (else its number was reused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    try:  # Linux: the process's state and start time (in clock ticks after boot)
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = int(re.search(r"^btime (\d+)$", Path("/proc/stat").read_text(), re.MULTILINE)[1])
    except (OSError, TypeError):  # no /proc: that it exists decides
        return True
    fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on; the name before may hold anything
    started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
    return fields[0] != "Z" and started <= changed + 1  # btime is in whole seconds


def _claim_abandoned(path: Path, match: re.Match) -> _Lock | None:
    """The lock of a temporary folder whose writer is gone, or None while it may still be at work."""
    try:
        lock = _Lock(path)
    except BlockingIOError:
        # held: by its writer, or by a process that inherited the lock from a writer since killed (a child it forked,
        # e.g. a data loader worker): the process named in the folder decides
        if match["host"] != _HOST or _writer_alive(int(match["pid"]), path.stat().st_mtime):
            return None
        lock = _Lock.__new__(_Lock)
        lock.fd = None
        return lock
    except (FileNotFoundError, NotADirectoryError, PermissionError):  # gone, or not ours
        return None
    # the lock is free, but a writer takes it a moment after creating the folder, and some filesystems have no flock
    if match["host"] == _HOST and _writer_alive(int(match["pid"]), path.stat().st_mtime):
        lock.close()
        return None
    if lock.fd is None and match["host"] != _HOST:  # no lock and another machine's process: cannot tell, leave it
        return None
    return lock


def recover(parent: str | os.PathLike) -> list[str]:
    """Repair what killed atomic writes left in `parent`: delete abandoned temporary folders, and move an abandoned
    aside folder back into place where its target is missing. Returns what was done, one line per folder; an
    abandoned folder that cannot be deleted is named in a warning."""
    parent, done = Path(parent), []
    if not parent.is_dir():
        return done
    for entry in sorted(parent.iterdir()):
        match = _TEMPORARY.match(entry.name)
        if match is None or not entry.is_dir() or entry.is_symlink():
            continue
        lock = _claim_abandoned(entry, match)
        if lock is None:
            continue
        try:
            target = parent / match["name"]
            if match["kind"] == "replaced" and not os.path.lexists(target):
                os.rename(entry, target)
                _fsync_directory(parent)
                done.append(f"restored {target} from {entry.name}")
            else:
                try:
                    shutil.rmtree(entry)
                except OSError as error:
                    warnings.warn(f"{entry} is left over from a write whose process ({match['pid']}) is gone, and "
                                  f"could not be deleted ({error}); delete it by hand.", stacklevel=2)
                else:
                    done.append(f"deleted {entry.name}")
        finally:
            lock.close()
    return done


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as error:  # some filesystems cannot sync a directory; the files themselves are synced
        if error.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_directory(Path(folder))


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two names in one step (Linux renameat2 RENAME_EXCHANGE). False where the system or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError, TypeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), ctypes.c_uint(_RENAME_EXCHANGE)) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _replace(staging: Path, target: Path) -> None:
    """Put the complete `staging` folder at `target` (see the module docstring)."""
    if not os.path.lexists(target):
        os.rename(staging, target)
        _fsync_directory(target.parent)
    elif _exchange(staging, target):  # staging now holds the old folder
        _fsync_directory(target.parent)
        shutil.rmtree(staging, ignore_errors=True)  # what a failure leaves, the next `recover` deletes
    else:
        aside = _temporary(target, "replaced")
        lock = _Lock(target)  # the old folder is ours until deleted, under either name
        try:
            try:
                os.rename(target, aside)
                os.rename(staging, target)
            except BaseException:  # also a signal's exception right after the first rename: put the old one back
                if os.path.lexists(aside) and not os.path.lexists(target):
                    os.rename(aside, target)
                raise
            _fsync_directory(target.parent)
            shutil.rmtree(aside, ignore_errors=True)
        finally:
            lock.close()


def _disk_full(folder: Path) -> int | None:
    """The errno of writing 1 MiB into `folder` where that fails for lack of space (else None)."""
    probe = folder / ".space-probe"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        return error.errno if error.errno in _OUT_OF_SPACE else None
    finally:
        with suppress(OSError):
            probe.unlink()
    return None


def _out_of_space(error: BaseException) -> int | None:
    """The errno of a full disk or a file size limit in `error` or its causes (safetensors reports it in its text)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in _OUT_OF_SPACE:
            return error.errno
        found = re.search(r"\b(?:code: |os error )(\d+)", str(error))  # Rust's io::Error, as safetensors words it
        if found and int(found[1]) in _OUT_OF_SPACE:
            return int(found[1])
        error = error.__cause__ or error.__context__
    return None


@contextmanager
def atomic_folder(
    target: str | os.PathLike,
    *,
    overwrite: bool = False,
    keep: Callable[[Path], bool] | None = None,
) -> Iterator[Path]:
    """Yield an empty temporary folder beside `target`; when the block ends without an error it replaces `target`
    in one step, on any error it is deleted (and `target` left as it was).

    overwrite: replace an existing non-empty `target` (otherwise FileExistsError).
    keep: entries of the existing `target` that the new folder should keep when it did not write them itself
        (hard-linked into it before the replacement, copied where links are impossible); by default none.
    Writers of the same target must not run at the same time (the last one wins); files added to `target` by
    someone else during the write are not carried over."""
    target = Path(os.path.abspath(target))
    if os.path.islink(target):
        target = Path(os.path.realpath(target))
    recover(target.parent)
    if target.exists():
        if not target.is_dir():
            raise FileExistsError(f"{target} is a file; the output must be a folder.")
        if not overwrite and any(target.iterdir()):
            raise FileExistsError(f"{target} already exists; choose a new output folder or pass overwrite=True.")
        if os.path.ismount(target):
            raise OSError(
                errno.EBUSY, f"{target} is a mount point, which cannot be replaced as a whole; write into a folder inside it."
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _temporary(target, "saving")
    os.mkdir(staging, 0o700)
    lock = _Lock(staging)
    existed = target.is_dir()
    installed = _sigterm_as_interrupt()
    try:
        yield staging
        if existed and keep is not None:
            for entry in target.iterdir():
                if not os.path.lexists(staging / entry.name) and keep(entry):
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.copytree(entry, staging / entry.name, symlinks=True, copy_function=_link_or_copy)
                    elif entry.is_symlink():
                        os.symlink(os.readlink(entry), staging / entry.name)
                    else:
                        _link_or_copy(entry, staging / entry.name)
        os.chmod(staging, target.stat().st_mode & 0o7777 if existed else 0o777 & ~_umask())
        _fsync_tree(staging)
        inside = _working_directory_inside(target)
        _replace(staging, target)
        if inside is not None:  # this process worked in the old folder, which is gone: move to the new one
            os.chdir(target / inside if (target / inside).is_dir() else target)
    except BaseException as error:
        if installed:  # a second SIGTERM during the clean-up kills at once
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if installed and isinstance(error, Terminated):
            shutil.rmtree(staging, ignore_errors=True)
            lock.close()
            os.kill(os.getpid(), signal.SIGTERM)  # then die by the signal, as without the handler
        code = _out_of_space(error)
        if code is None and isinstance(error, (OSError, RuntimeError)):  # a writer that gives no errno (torch.save)
            code = _disk_full(staging)
        shutil.rmtree(staging, ignore_errors=True)
        if code is not None:
            free = shutil.disk_usage(target.parent).free / 2**30
            state = f"{target} is unchanged" if existed else f"no {target} was created"
            raise OutOfSpaceError(
                code,
                f"Not enough space to write {target} ({os.strerror(code)}; {free:.2f} GiB free there). Nothing was "
                f"changed: {state} and the partial copy was deleted. Free some space (or choose another folder) and "
                "write it again.",
            ) from error
        raise
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        lock.close()


def _working_directory_inside(folder: Path) -> Path | None:
    try:
        return Path(os.getcwd()).relative_to(folder)
    except (ValueError, FileNotFoundError):
        return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
