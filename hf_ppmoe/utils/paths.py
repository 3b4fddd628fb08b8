"""The one check of every path a command takes, run on the parsed flags before any work (see
`utils.command_line.parse_arguments`): an argument dataclass names the kind of each path field in a class attribute,
`PATHS: ClassVar[dict] = {"output_dir": "output_folder", "resume": ("input_folder", ("latest",))}` (a kind, or a
kind and the words that field takes that are not paths; subclasses add theirs), so the dataclass stays one that
Transformers' `HfArgumentParser` takes as it is; a wrong path ends as one `PROG: error: ...` line with exit code 2,
before anything is read or written. Standard library only: the check runs before torch is imported.

Kinds:
  input_file     an existing readable file (a glob: it matches at least one, every match a file)
  input          an existing file or folder (a config.json or the folder holding it)
  input_folder   an existing folder
  model          a local folder or, when no such path exists, a Hub repository id (user/name); a path that can only
                 be local (`./x`, `/x`, `~/x`, `a/b/c`, or `a/b` with a folder `a` here) must exist
  output_folder  a folder or a path that does not exist yet; its nearest existing ancestor a writable folder
  output_file    a file or a path that does not exist yet; its nearest existing ancestor a writable folder
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

KINDS = ("input_file", "input", "input_folder", "model", "output_folder", "output_file")
# huggingface_hub's rule for repository ids, without importing it: name or user/name, no "--" or ".." in it
_HUB_ID = re.compile(r"^(?:[\w\-.]{1,96}/)?[\w\-.]{1,96}$")


def _writable_ancestor(path: Path, flag: str) -> str | None:
    """Why a path that does not exist yet cannot be created, or None."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{flag} {path}: {parent} is a file, not a folder; choose a path in a folder."
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag} {path}: the folder {parent} is not writable; choose a folder you can write to."
    return None


def _looks_local(value: str) -> bool:
    """Whether a model path that does not exist can only mean a local folder: `./x`, `../x`, `/x`, `~/x`, or a path
    whose parent folder exists (`runs/x` with `runs/` here), which a Hub id (user/name) would not be."""
    if value.startswith((".", "/", "~")) or value.count("/") > 1 or "\\" in value:
        return True
    parent = Path(value).parent
    return parent != Path(".") and parent.is_dir()


def path_problem(value: str, kind: str, flag: str) -> str | None:
    """Why `value` is not a path of `kind` (a one-line message naming the flag and the fix), or None if it is."""
    if kind not in KINDS:
        raise ValueError(f"unknown path kind {kind!r}; use one of {', '.join(KINDS)}")
    path = Path(os.path.expanduser(value))
    if kind == "input_file" and glob.has_magic(value):
        matches = glob.glob(os.path.expanduser(value), recursive=True)
        if not matches:
            return f"{flag} {value}: no file matches this pattern."
        return next((path_problem(match, kind, flag) for match in matches if path_problem(match, kind, flag)), None)
    if kind in ("output_folder", "output_file"):
        if not path.exists():
            return _writable_ancestor(path, flag)
        if kind == "output_folder" and not path.is_dir():
            return f"{flag} {value} is a file; give a folder (a new one is created)."
        if kind == "output_file" and path.is_dir():
            return f"{flag} {value} is a folder; give a file name."
        if not os.access(path, os.W_OK):
            return f"{flag} {value} is not writable; choose a path you can write to."
        return None
    if kind == "model" and not path.exists():
        if _looks_local(value):  # no Hub look-up for a path the user meant on this machine
            return f"{flag} {value}: no such folder."
        if _HUB_ID.match(value) and "--" not in value and ".." not in value:
            return None  # a Hub id: its existence is the loader's question (it may be in the local cache)
        return f"{flag} {value}: no such folder, and not a Hub repository id (user/name)."
    if not path.exists():
        return f"{flag} {value}: no such {'file' if kind == 'input_file' else 'folder' if kind != 'input' else 'file or folder'}."
    if kind == "input_file" and path.is_dir():
        return f"{flag} {value} is a folder; give a file."
    if kind in ("input_folder", "model") and not path.is_dir():
        return f"{flag} {value} is a file; give {'the model' if kind == 'model' else 'a'} folder."
    if not os.access(path, os.R_OK):
        return f"{flag} {value} is not readable; check its permissions."
    return None


def path_kinds(arguments: type) -> dict[str, tuple[str, tuple[str, ...]]]:
    """{field: (kind, words that are not paths)} of an argument dataclass and its bases (`PATHS`)."""
    kinds = {}
    for cls in reversed(arguments.__mro__):
        for name, kind in vars(cls).get("PATHS", {}).items():
            kinds[name] = (kind, ()) if isinstance(kind, str) else kind
    return kinds


def paths_problem(arguments: type, values: dict, positionals: dict[str, str] = {}) -> str | None:
    """The first problem among the path fields of the argument dataclass `arguments` given their parsed `values` by
    name (`positionals`: field name -> metavar, e.g. SRC)."""
    for name, (kind, words) in path_kinds(arguments).items():
        value = values.get(name)
        if value is None:
            continue
        flag = positionals.get(name, f"--{name}")
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item in words:
                continue
            problem = path_problem(str(item), kind, flag)
            if problem:
                return problem
    return None
