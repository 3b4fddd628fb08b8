"""`python -m hf_ppmoe.training` / `accelerate launch -m hf_ppmoe.training`: fine-tune GPT-MoE with Accelerate; and
`MoETrainer` / `MoESeq2SeqTrainer` for Transformers' Trainer (hf_ppmoe.training.trainer).

Names load on first use (module `__getattr__`): `--help` and argument errors of the command print before torch is
imported (the arguments need only the standard library)."""

import importlib

_NAMES = {"TrainArguments": "arguments", "main": "train", "MoESeq2SeqTrainer": "trainer", "MoETrainer": "trainer",
          "MoETrainerMixin": "trainer"}

__all__ = ["MoESeq2SeqTrainer", "MoETrainer", "MoETrainerMixin", "TrainArguments", "main"]


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
