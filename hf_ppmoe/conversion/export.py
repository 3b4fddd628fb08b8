"""GPT-MoE / Seq2Seq-MoE -> Transformers' own MoE classes, where the model fits one exactly.

An exported folder loads with plain Transformers (no hf_ppmoe, no remote code) as `MixtralForCausalLM`,
`Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM`, `Glm4MoeForCausalLM` or `SwitchTransformersForConditionalGeneration`,
in the layout Transformers' own `save_pretrained` writes (per-expert tensors, as on the Hub), and computes what our
model computes: the same logits, and in training the same routing (no capacity, jitter or random routing that the
target would do differently).

Each target is an `Architecture` (mixtral.py, qwen_moe.py, glm4_moe.py, t5.py: what it computes, checked by its
`reasons`): its `config` writes our config as its, and its weight table, read as an import, runs backwards. Router
losses are the target's own and not part of the check: Mixtral and Qwen add a load-balancing loss pooled over all
layers (for one MoE layer K times ours; only with output_router_logits=True) and no z-loss; Switch adds its
per-sequence aux and z-losses. The coefficients are carried unchanged.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from ..modeling import GPTMoEConfig, Seq2SeqMoEConfig
from .adapter import Architecture
from .architectures import ARCHITECTURES
from .choices import EXPORT_CLASSES
from .delivery import deliver, expected_tensors
from .io import open_checkpoint
from .mapping import ConversionError
from .upcycling import moe_config_loader

TARGETS: dict[str, Architecture] = {name: ARCHITECTURES[name] for name in EXPORT_CLASSES}


def _target(to: str) -> Architecture:
    if to not in TARGETS:
        raise ConversionError(f"unknown export target {to!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[to]


def _config_of(moe):
    config = moe if isinstance(moe, (GPTMoEConfig, Seq2SeqMoEConfig)) else getattr(moe, "config", None)
    if config is None:
        return open_checkpoint(moe, moe_config_loader("exporting (hf-ppmoe export, export_moe)")).config
    return config


def export_reasons(moe, to: str) -> list[str]:
    """Everything that keeps `moe` (a GPT-MoE / Seq2Seq-MoE model, config or folder) from being exported to `to`
    exactly, one sentence per setting (naming it and what the target does instead); empty when it fits."""
    target, config = _target(to), _config_of(moe)
    if config.model_type != target.family:
        fitting = [t.model_type for t in TARGETS.values() if t.family == config.model_type]
        return [f"a {config.model_type} model cannot become a {target.class_name} (which takes {target.family} "
                f"models); targets for {config.model_type}: {', '.join(fitting)}"]
    return target.reasons(config)


def export_moe(
    moe,
    save_directory: str | Path | None = None,
    *,
    to: str,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    progress: bool = False,
):
    """Export a GPT-MoE or Seq2Seq-MoE (a model object or a folder written by save_pretrained / upcycle /
    import_moe) to Transformers' own class `to`: "mixtral" (MixtralForCausalLM), "qwen2_moe" (Qwen2MoeForCausalLM),
    "qwen3_moe" (Qwen3MoeForCausalLM), "glm4_moe" (Glm4MoeForCausalLM) or "switch_transformers"
    (SwitchTransformersForConditionalGeneration).

    Only a model the target computes exactly is exported; otherwise `ConversionError` lists every reason
    (`export_reasons` gives the list without raising). Returns the target model, or writes the folder there (sharded
    safetensors in the target's Hub layout, its config, the source's tokenizer and generation config) tensor by
    tensor through a temporary folder, and returns its path. The folder loads with `AutoModelForCausalLM` /
    `AutoModelForSeq2SeqLM` without hf_ppmoe."""
    target = _target(to)
    checkpoint = open_checkpoint(moe, moe_config_loader("exporting (hf-ppmoe export, export_moe)"))
    config = checkpoint.config
    reasons = export_reasons(config, to)
    if reasons:
        raise ConversionError(
            f"This {type(config).__name__} cannot be exported to {target.class_name} exactly:\n  - "
            + "\n  - ".join(reasons)
        )
    if config.router_z_loss_coef > 0 and target.model_type != "switch_transformers":
        warnings.warn(
            f"router_z_loss_coef={config.router_z_loss_coef} is not exported: {target.class_name} has no router z-loss "
            "(the exported model computes the same logits; only training with Transformers' loss differs).",
            stacklevel=2,
        )
    import transformers

    model_class = getattr(transformers, target.class_name)
    target_config = target.config(config)
    target_config.architectures = [target.class_name]
    _, stored = expected_tensors(model_class, target_config)
    ours = checkpoint.tensors
    # our untied head goes into a head the target ties by default (Switch); Transformers unties what differs
    names = frozenset(stored | ({"lm_head.weight"} & set(ours.keys())))
    meta = ours.meta()
    dtype = meta.get(next(k for k in meta.keys() if meta.get(k).is_floating_point())).dtype  # of created tensors
    return deliver(
        target.mapping(target_config, names, ours=config, dtype=dtype).inverse().apply(ours),
        target_config,
        model_class,
        checkpoint,
        save_directory=save_directory,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        progress=progress,
        conversion="export",
    )


__all__ = ["TARGETS", "export_moe", "export_reasons"]
