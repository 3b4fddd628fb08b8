"""What a checkpoint carries beyond Transformers' own files, and what loading one checks of the MoE tensors.

Transformers' remote-code loader copies only the files a model's modules import with `from .name import ...`, so
`save_pretrained` writes a flattened copy of every module the model needs (`hf_ppmoe/moe/layer.py` ->
`moe_layer.py`, imports rewritten), the `auto_map` pointing at them, and `custom_generate/generate.py` (flat beam
search). Loading an MoE checkpoint that lacks a router or expert tensor, or holds an extra one, is an error
(`check_moe_tensors_loaded`).
"""

import importlib.util
import os
import re
import sys
from pathlib import Path

from ..generation.flat_beam_search import generate as flat_beam_generate
from ..moe.layer import MoELayer

_RELATIVE_IMPORT = re.compile(r"^(\s*)from\s+(\.+[\w.]*)\s+import\s", flags=re.MULTILINE)


def _flat_name(module_name: str) -> str:
    """hf_ppmoe.moe.layer -> moe_layer; hf_ppmoe.modeling.x -> x; an already flattened module keeps its name."""
    parts = module_name.split(".")
    if parts[0] == "hf_ppmoe" and len(parts) == 3 and parts[1] != "modeling":
        return f"{parts[1]}_{parts[2]}"
    return parts[-1]


def write_remote_code(folder: str | os.PathLike, module_names: list[str]) -> list[str]:
    """Write flattened copies of `module_names` and every module they import relatively into `folder`."""
    written, todo = {}, list(module_names)
    while todo:
        name = todo.pop()
        if name in written:
            continue
        module = sys.modules[name]
        source = Path(module.__file__).read_text(encoding="utf-8")

        def rewrite(match, package=module.__package__):
            target = importlib.util.resolve_name(match.group(2), package)
            if importlib.util.find_spec(target) is None or target.count(".") == 0:
                raise ImportError(f"{name}: cannot carry relative import {match.group(2)!r} into a checkpoint")
            todo.append(target)
            return f"{match.group(1)}from .{_flat_name(target)} import "

        written[name] = _RELATIVE_IMPORT.sub(rewrite, source)
    for name, source in written.items():
        Path(folder, f"{_flat_name(name)}.py").write_text(source, encoding="utf-8")
    return [f"{_flat_name(n)}.py" for n in written]


def write_custom_generate(folder: str | os.PathLike) -> None:
    """`custom_generate/generate.py`: flat beam search, whose module imports only torch and transformers."""
    source = Path(sys.modules[flat_beam_generate.__module__].__file__).read_text(encoding="utf-8")
    if _RELATIVE_IMPORT.search(source):
        raise ImportError("custom_generate/generate.py must be self-contained (no relative imports)")
    Path(folder, "custom_generate").mkdir(exist_ok=True)
    Path(folder, "custom_generate", "generate.py").write_text(source, encoding="utf-8")


def add_remote_code(folder: str | os.PathLike, model_class: type, config) -> None:
    """Point `config.auto_map` at `model_class` (and its `_auto_classes`) and write the flattened modules they need
    into `folder`, so the checkpoint there loads with `trust_remote_code=True` where hf_ppmoe is not installed."""
    model_module, config_module = model_class.__module__, type(config).__module__
    config.auto_map = {
        "AutoConfig": f"{_flat_name(config_module)}.{type(config).__name__}",
        **{auto: f"{_flat_name(model_module)}.{cls}" for auto, cls in model_class._auto_classes.items()},
    }
    write_remote_code(folder, [model_module, config_module])


def _is_moe_tensor(name: str, moe_prefixes: tuple[str, ...]) -> bool:
    """A tensor of an MoE layer of the model (router or experts), or one that names a router or experts."""
    return name.startswith(moe_prefixes) or not {"experts", "gate", "router"}.isdisjoint(name.split("."))


def check_moe_tensors_loaded(model, loading_info: dict, source) -> None:
    """Raise `ValueError` naming the router / expert tensors that `loading_info` (Transformers' load report) lists as
    missing from the checkpoint or unexpected in it."""
    prefixes = tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, MoELayer))
    problems = {
        what: sorted(name for name in loading_info.get(key, ()) if _is_moe_tensor(name, prefixes))
        for what, key in (("missing from the checkpoint", "missing_keys"), ("not in the model", "unexpected_keys"))
    }
    if not any(problems.values()):
        return
    listed = "; ".join(f"{what}: {', '.join(names)}" for what, names in problems.items() if names)
    raise ValueError(
        f"{source} does not hold this MoE model's router and expert weights ({listed}). Loading it would initialise "
        "those anew (or drop them) and give another model. Load the checkpoint it was saved as, or pass "
        "from_pretrained(..., strict_moe=False) to load anyway with Transformers' load report."
    )
