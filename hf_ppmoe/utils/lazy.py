"""Names a package loads on first use (module `__getattr__`, PEP 562), so that importing it imports nothing heavy:
`__getattr__, __dir__ = lazy_names(__name__, {"name": "submodule", ...})` in the package's `__init__.py`."""

from __future__ import annotations

import importlib
import sys


def lazy_names(package: str, names: dict[str, str]):
    """The `__getattr__` and `__dir__` of `package` for `names` (public name -> the submodule that defines it)."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{names[name]}", package), name)
        setattr(sys.modules[package], name, value)  # found directly from now on
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
