"""hf_ppmoe: Mixture-of-Experts models for Hugging Face Transformers, built the Pipeline-MoE way.

Importing the package registers our configs and models with Transformers' Auto classes, and costs no more than
`import transformers`: submodules and public names load on first use (module `__getattr__`, as Transformers' own
`_LazyModule`), and the Auto classes learn our model types by name (once they are imported: now, or when they load
later), resolving the classes from this package only when a model of ours is asked for (as Transformers' own models
are). Resolving a model class also registers the plan
styles our configs name ("ppmoe_ffn", ...) with Transformers (`hf_ppmoe.parallel`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

_PUBLIC = {  # name -> submodule that defines it
    "GPTMoEConfig": "modeling",
    "GPTMoEForCausalLM": "modeling",
    "GPTMoEModel": "modeling",
    "Seq2SeqMoEConfig": "modeling",
    "Seq2SeqMoEForConditionalGeneration": "modeling",
    "Seq2SeqMoEModel": "modeling",
    "plan": "planning",
}
_SUBMODULES = ("cli", "conversion", "generation", "modeling", "moe", "parallel", "peft", "planning", "training", "utils")
# model_type -> (config class, {Auto class: model class}); tests/test_lazy_import.py checks them against the classes
_MODELS = {
    "gpt_moe": ("GPTMoEConfig", {"AutoModel": "GPTMoEModel", "AutoModelForCausalLM": "GPTMoEForCausalLM"}),
    "seq2seq_moe": ("Seq2SeqMoEConfig", {"AutoModel": "Seq2SeqMoEModel",
                                         "AutoModelForSeq2SeqLM": "Seq2SeqMoEForConditionalGeneration"}),
}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        module = importlib.import_module(f".{_PUBLIC[name]}", __name__)
        if _PUBLIC[name] == "modeling" and not name.endswith("Config"):
            _register_plan_styles()
        value = getattr(module, name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC) | set(_SUBMODULES))


def _register_plan_styles() -> None:
    import torch.distributed

    if torch.distributed.is_available():
        from . import parallel  # noqa: F401  registers "ppmoe_ffn", ... with Transformers' tensor parallelism


def _register_classes() -> None:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    autos = {"AutoModel": AutoModel, "AutoModelForCausalLM": AutoModelForCausalLM,
             "AutoModelForSeq2SeqLM": AutoModelForSeq2SeqLM}
    for model_type, (config_name, models) in _MODELS.items():
        config = __getattr__(config_name)
        AutoConfig.register(model_type, config, exist_ok=True)
        for auto, model_name in models.items():
            autos[auto].register(config, __getattr__(model_name), exist_ok=True)


def _register() -> None:
    """Our model types in the Auto classes: by name (utils/transformers_private.py, where Transformers' private
    tables are written), else through the public `register` API, which imports the classes now."""
    from .utils.transformers_private import register_auto_names

    if not register_auto_names(_MODELS, sys.modules[__name__]):
        _register_classes()


class _RegisterWhenAutoLoads(importlib.abc.MetaPathFinder):
    """Runs `_register` right after Transformers' Auto classes (transformers.models.auto) are imported, so that
    `import hf_ppmoe` alone imports neither Transformers nor torch (the `hf-ppmoe` commands answer `--help` and
    refuse bad flags before torch loads) and the Auto classes still know our models whenever they are used."""

    def find_spec(self, name, path, target=None):
        if name != _AUTO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


_AUTO = "transformers.models.auto"
if _AUTO in sys.modules:
    _register()
elif not any(isinstance(finder, _RegisterWhenAutoLoads) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenAutoLoads())
