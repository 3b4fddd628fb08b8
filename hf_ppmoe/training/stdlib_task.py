"""The built-in seq2seq task: a Python function of the CPython standard library -> the first sentence of its
docstring. Every Python installation ships the sources, so the task needs no download; pairs are read with `ast`
in a fixed order (sorted files, then source order), so the same Python gives the same pairs.

source: the function (decorators, signature and body) with its docstring removed, as `ast.unparse` writes it.
target: the docstring's first sentence (its first paragraph up to the first ". "), when it has 3 to 30 words.

The split is by file: the functions of `EVALUATION_FILES` are the validation pairs, all other files' are the
training pairs, so no function of a validation file is seen in training. Left out: tests, GUI toolkits, demos and
vendored or generated code (`_EXCLUDED`).
"""

from __future__ import annotations

import ast
import functools
import re
import sysconfig
from pathlib import Path

EVALUATION_FILES = (
    "argparse.py", "calendar.py", "fractions.py", "ftplib.py", "gzip.py", "heapq.py", "ipaddress.py",
    "json/decoder.py", "json/encoder.py", "shlex.py", "statistics.py", "textwrap.py", "wave.py", "zipfile.py",
)
_EXCLUDED = re.compile(
    r"^(site-packages|test|idlelib|lib2to3|tkinter|turtledemo|ensurepip|pydoc_data|venv/scripts)/|(^|/)tests?/|"
    r"^(turtle|_pydecimal|_pyio)\.py$"
)
_WORDS = (3, 30)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def first_sentence(docstring: str) -> str | None:
    """The first sentence of a docstring's first paragraph (whitespace collapsed), or None outside 3-30 words."""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    sentence = re.split(r"(?<=[.!?])\s", paragraph, maxsplit=1)[0]
    return sentence if _WORDS[0] <= len(sentence.split()) <= _WORDS[1] else None


def file_pairs(path: Path) -> list[dict]:
    """{"source", "target", "name"} of each documented function in a Python file, in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):  # a few stdlib files are templates or other encodings
        return []
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        docstring = ast.get_docstring(node)
        target = first_sentence(docstring) if docstring else None
        if target is None or len(node.body) < 2:
            continue
        node.body = node.body[1:]  # the docstring goes; the pair is built before walking into this function
        pairs.append({"source": ast.unparse(node), "target": target, "name": node.name})
        node.body.insert(0, ast.Expr(ast.Constant(docstring)))
    return pairs


@functools.cache
def stdlib_pairs(max_train_files: int | None = None) -> tuple[list[dict], list[dict]]:
    """(training pairs, validation pairs) of the installed Python's standard library; each pair also names its
    "file". max_train_files: read only the first n training files (in sorted order), for quick runs."""
    root = stdlib_root()
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    missing = [name for name in EVALUATION_FILES if name not in files]
    if missing:
        raise FileNotFoundError(f"The standard library at {root} lacks the evaluation files {missing}; the built-in task "
                                "needs a full CPython installation (or pass --train_file with your own pairs).")
    training = [name for name in files if name not in EVALUATION_FILES and not _EXCLUDED.search(name)]
    train, validation = [], []
    for name in training[:max_train_files]:
        train += [{**pair, "file": name} for pair in file_pairs(root / name)]
    for name in EVALUATION_FILES:
        validation += [{**pair, "file": name} for pair in file_pairs(root / name)]
    return train, validation
