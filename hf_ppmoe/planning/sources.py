"""The model a plan is for, from what a user has: a GPT-MoE config (object, folder or config.json), a dense or MoE
checkpoint's config of an architecture hf_ppmoe converts (its GPT-MoE config as `hf-ppmoe import` makes it, or, with
upcycle options, as `hf-ppmoe upcycle` makes it: `hf_ppmoe.conversion.upcycled_config`), read without any weight."""

from __future__ import annotations

import json
from pathlib import Path

from ..conversion.architectures import ARCHITECTURES, get_architecture, supported
from ..conversion.mapping import ConversionError
from ..conversion.upcycling import upcycled_config
from ..modeling import GPTMoEConfig

UPCYCLE_OPTIONS = ("num_experts", "num_experts_per_tok", "router_type", "moe_layer_frequency", "moe_layers",
                   "granularity")


def _read(path: Path) -> dict:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path}: no config.json there; give a model folder (written by save_pretrained) or its "
                         "config.json.")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{file} is not JSON ({error}).") from None


def model_config(model, **upcycle) -> GPTMoEConfig:
    """A GPT-MoE config for `model`: a config object, or a folder / config.json. `upcycle` (upcycle's options:
    num_experts, num_experts_per_tok, router_type, moe_layer_frequency, moe_layers, granularity) turns a dense
    model into the MoE `hf-ppmoe upcycle` would make; without them a dense model is planned as it is."""
    from transformers import AutoConfig

    unknown = set(upcycle) - set(UPCYCLE_OPTIONS)
    if unknown:
        raise TypeError(f"unknown upcycle option(s) {sorted(unknown)}; they are {', '.join(UPCYCLE_OPTIONS)}.")
    upcycle = {k: v for k, v in upcycle.items() if v is not None}
    if isinstance(model, GPTMoEConfig):
        config = model
    else:
        if isinstance(model, (str, Path)):
            data = _read(Path(model))
            model_type = data.get("model_type")
            if model_type == "gpt_moe":
                config = GPTMoEConfig.from_dict(data)
            elif model_type in ARCHITECTURES:
                config = AutoConfig.for_model(**data)
            else:
                raise ValueError(f"{model}: model_type {model_type!r} cannot be planned; plan a GPT-MoE or a source "
                                 f"hf_ppmoe converts ({supported()}).")
        else:
            config = model
        if not isinstance(config, GPTMoEConfig):
            config = _converted(config, upcycle)
            upcycle = {}
    if upcycle:
        raise ValueError(f"{type(config).__name__} is already an MoE model; the upcycle options "
                         f"({', '.join(sorted(upcycle))}) apply to a dense model.")
    return config


def _converted(config, upcycle: dict) -> GPTMoEConfig:
    """The GPT-MoE config conversion makes of a Transformers config."""
    model_type = getattr(config, "model_type", None)
    arch = ARCHITECTURES.get(model_type)
    if arch is None or arch.family != "gpt_moe":
        raise ValueError(f"model_type {model_type!r}: the planner plans decoder models (GPT-MoE); {supported()}.")
    try:
        if arch.moe:  # an MoE checkpoint: hf-ppmoe import's config
            if upcycle:
                raise ValueError(f"{model_type} is already an MoE model; the upcycle options apply to a dense model.")
            get_architecture(model_type, moe=True)  # refuses what ours cannot be read from (export-only targets)
            return GPTMoEConfig(**arch.fields(config, frozenset()))
        if upcycle:
            return upcycled_config(config, **upcycle)
        get_architecture(model_type, moe=False)
        return GPTMoEConfig(**arch.fields(config, frozenset()), num_experts=1, num_experts_per_tok=1, moe_layers=[])
    except ConversionError as error:
        raise ValueError(str(error)) from None


__all__ = ["UPCYCLE_OPTIONS", "model_config"]
