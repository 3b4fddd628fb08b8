"""MoE -> dense: merge each MoE layer's experts back into one FFN and write the original dense architecture (a
GPT-MoE into GPT-2 / Llama / Mistral / Qwen2 / Qwen3, a Seq2Seq-MoE into T5).

The merge is the inverse of upcycling, table for table: `experts_mapping(...).inverse()` merges the experts (a
weighted mean in float64; E identical float32 copies give back the same bits) and drops the router, then the source
architecture's table, inverted, restores its names (GPT-2's Conv1D transposes, fused c_attn, ...). The down-projection
is multiplied back by the gate's uniform combine sum (1 / the scale upcycling applied), so a freshly upcycled model
merges back to the dense weights exactly: bit for bit when that scale is a power of two (1 for topk with
renormalisation and gshard; E for switch with E a power of two), to one float rounding otherwise.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .architectures import get_architecture
from .choices import MERGE_METHODS
from .io import open_checkpoint
from .mapping import ConversionError
from .delivery import deliver
from .upcycling import MODEL_CLASSES, experts_mapping, moe_config_loader, moe_ffns, run_on_text, sample_ids



@torch.no_grad()
def expert_usage(model, sample_texts: list[str], tokenizer) -> dict[int, torch.Tensor]:
    """Routes each expert received per MoE layer ({FFN number (see `moe_ffns`): counts [E]}) over `sample_texts`,
    padding excluded; an encoder-decoder reads each text in its encoder and, as its target, in its decoder."""
    if not sample_texts:
        raise ConversionError("method='usage' needs sample_texts to measure how often the router picks each expert")
    ffns = moe_ffns(model.config)
    E = model.config.num_experts
    counts = {n: torch.zeros(E, dtype=torch.float64) for n in ffns}
    was_training = model.training
    model.eval()
    try:
        for text in sample_texts:
            out = run_on_text(model, sample_ids(tokenizer, text, model), output_router_logits=True, use_cache=False)
            if model.config.is_encoder_decoder:
                routes = out.encoder_router_expert_ids + out.decoder_router_expert_ids
            else:
                routes = out.router_expert_ids
            for n, expert_ids in zip(ffns, routes, strict=True):
                counts[n] += torch.bincount(expert_ids.flatten().cpu(), minlength=E + 1)[:E].double()
    finally:
        model.train(was_training)
    return counts


def _merge_weights(method, config, ffns, expert, usage, granularity: int = 1) -> dict[int, tuple[float, ...]]:
    """A weight per copy of the FFN (per expert, or per `granularity` consecutive experts: the slices of one copy)."""
    E = config.num_experts
    C = E // granularity
    if method == "mean":
        return {n: (1.0 / C,) * C for n in ffns}
    if method == "expert":
        if not 0 <= expert < E:
            raise ConversionError(f"expert={expert} does not exist; the model has experts 0..{E - 1}")
        return {n: tuple(float(c == expert // granularity) for c in range(C)) for n in ffns}
    weights = {}
    for n, prefix in ffns.items():
        total = float(usage[n].sum())
        if total == 0:
            raise ConversionError(f"no sample token reached any expert of {prefix.rstrip('.')}; give more sample_texts")
        weights[n] = tuple((usage[n].view(C, granularity).sum(1) / total).tolist())
    return weights


def merge_experts(
    moe,
    *,
    method: str = "mean",
    expert: int = 0,
    sample_texts: list[str] | None = None,
    tokenizer=None,
    save_directory: str | Path | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    progress: bool = False,
):
    """Merge an MoE model made by `upcycle` or `import_moe` (a model object or a folder) back into its dense
    architecture (GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    T5ForConditionalGeneration),
    loadable by plain Transformers.

    method: "mean" (mean of the experts), "usage" (mean weighted by how often the router picks each expert on
        `sample_texts`, tokenized with `tokenizer` or the folder's tokenizer), or "expert" (keep expert `expert`).
    A fine-grained upcycle (granularity g) merges copy by copy: its g slices joined, "expert" keeps the copy that
    expert `expert` is a slice of, "usage" weighs a copy by its slices' picks.
    Returns the dense model, or writes it to `save_directory` and returns the path.
    """
    if method not in MERGE_METHODS:
        raise ValueError(f"method={method!r}; use one of {', '.join(MERGE_METHODS)}.")
    if method == "usage" and not sample_texts:  # before anything is loaded
        raise ConversionError(
            "method='usage' needs sample_texts to measure how often the router picks each expert (on the command "
            "line: --sample_texts TEXT ... or --sample_file FILE)"
        )

    checkpoint = open_checkpoint(moe, moe_config_loader("merging (hf-ppmoe merge, merge_experts)"))
    config = checkpoint.config
    record = getattr(config, "conversion", None)
    if not isinstance(record, dict) or "dense_config" not in record:
        raise ConversionError(
            f"this {type(config).__name__} has no record of a dense architecture (config.conversion, written by upcycle "
            "and import_moe), so there is no original class to merge back into."
        )
    if record["dense_config"] is None:
        imported = (record.get("imported_from") or {}).get("model_type", "MoE")
        why = "merge_experts has no dense class to write it as"
        if config.moe_intermediate_size not in (None, config.intermediate_size):
            why = (f"its dense layers (intermediate_size={config.intermediate_size}) and experts (moe_intermediate_size="
                   f"{config.moe_intermediate_size}) differ in size, and a dense model has one FFN size")
        raise ConversionError(f"this model was imported from a {imported} checkpoint that has no dense twin: {why}.")
    scale = record.get("expert_output_scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ConversionError(
            f"config.conversion.expert_output_scale={scale!r}: it must be a positive finite number (upcycle records the "
            "factor it scaled the experts by; merging divides by it). The config was edited or damaged."
        )
    if config.shared_expert_intermediate_size:
        raise ConversionError("merging a model with a shared expert is not supported: the dense FFN has no place for it")

    from transformers import CONFIG_MAPPING

    dense_dict = record["dense_config"]
    arch = get_architecture(dense_dict.get("model_type"), moe=False)
    dense_config = CONFIG_MAPPING[arch.model_type].from_dict(dense_dict)
    ffns = moe_ffns(config)

    usage = None
    if method == "usage":
        model = checkpoint.model
        if model is None:
            model = MODEL_CLASSES[config.model_type].from_pretrained(checkpoint.folder)
        if tokenizer is None and checkpoint.folder is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(checkpoint.folder)
        if tokenizer is None:
            raise ConversionError("method='usage' needs a tokenizer for the sample texts; pass tokenizer=...")
        usage = expert_usage(model, sample_texts, tokenizer)
        del model

    granularity = record.get("granularity", 1)  # fine-grained upcycling: copies of `granularity` slices each
    weights = _merge_weights(method, config, ffns, expert, usage, granularity)
    experts = experts_mapping(config, scale=scale, merge_weights=weights, granularity=granularity).inverse()
    dense_names = experts.apply(checkpoint.tensors)
    import transformers

    return deliver(
        arch.mapping(dense_config, frozenset(dense_names.keys())).inverse().apply(dense_names),
        dense_config,
        getattr(transformers, arch.class_name),
        checkpoint,
        save_directory=save_directory,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        progress=progress,
        conversion="merge",
        tokenizer=tokenizer if checkpoint.folder is None else None,
    )


__all__ = ["MERGE_METHODS", "expert_usage", "merge_experts"]
