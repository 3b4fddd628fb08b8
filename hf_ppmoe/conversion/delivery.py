"""The part every conversion shares: check the converted tensors against the target model, then write them (or load
the result when no output folder is asked for)."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from ..utils.atomic import atomic_folder
from ..utils.integrity import write_checksums
from ..utils.model_card import conversion_card, write_card
from .io import Checkpoint, carry_side_files, model_tensors, write_safetensors
from .mapping import ConversionError, MappedSource, TensorSource, shape_str


def expected_tensors(model_class, config) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every tensor of `model_class(config)` by name (on the meta device), and the names a checkpoint must hold: those
    `save_pretrained` writes (Transformers' load-time renamings undone, e.g. Mixtral's fused experts back to one
    tensor per expert). Tied copies are optional (saved once; a stored copy that differs unties it when loading,
    which is how a T5 checkpoint says that its head is untied)."""
    with torch.device("meta"):
        model = model_class(config)
    stored = model_tensors(model)
    targets = dict(model.state_dict())
    targets.update({name: stored.get(name) for name in stored.keys()})
    return targets, set(stored.keys())


def plan_tensors(tensors: TensorSource, expected: tuple[dict, set[str]]) -> list[tuple[str, torch.Size, torch.dtype]]:
    """Run the whole conversion on meta tensors and compare with `expected` (see `expected_tensors`): a shape
    mismatch names the source tensors it comes from; an integer or boolean tensor where the target has a
    floating-point one, and a tensor the target needs but the conversion does not produce, are errors. Returns the
    write plan."""
    targets, required = expected
    meta = tensors.meta()
    plan, mismatched, integer = [], [], []
    for name in meta.keys():
        t = meta.get(name)
        if name not in targets:
            raise ConversionError(f"the conversion produced {name} (from {tensors.describe(name)}), which the target model does not have")
        if tuple(t.shape) != tuple(targets[name].shape):
            mismatched.append(f"{name} would be {shape_str(t)} but must be {list(targets[name].shape)} (from {tensors.describe(name)})")
        if targets[name].is_floating_point() and not t.is_floating_point():
            integer.append(f"{name} would be {t.dtype} (from {tensors.describe(name)})")
        plan.append((name, t.shape, t.dtype))
    if mismatched:
        raise ConversionError(
            "tensor shapes in the source do not match its config.json:\n  " + "\n  ".join(mismatched[:8])
        )
    if integer:
        raise ConversionError(
            f"the source stores weights as integers where the model's are floating point: {'; '.join(integer[:4])}. "
            "Converters copy weights without casting them, and an integer weight is a quantized or damaged file: "
            "convert the floating-point original (float32, bfloat16 or float16), or cast these tensors to a "
            "floating-point dtype first if their values are the weights."
        )
    missing = sorted(required - {name for name, _, _ in plan})
    if missing:
        raise ConversionError(f"the conversion does not produce {', '.join(missing[:8])}, which the target model needs")
    return plan


def deliver(
    tensors: MappedSource,
    config,
    model_class,
    checkpoint: Checkpoint,
    *,
    save_directory=None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    progress: bool = False,
    tokenizer=None,
    conversion: str,
):
    """Write the converted checkpoint into `save_directory` (returned as a Path), or, without one, load and return the
    converted model (written to a temporary folder first, so both paths are the same code). conversion: what was
    done (upcycle, import, merge, export), for the model card."""
    plan = plan_tensors(tensors, expected_tensors(model_class, config))
    if save_directory is None:
        with tempfile.TemporaryDirectory(prefix="hf-ppmoe-convert-") as tmp:
            folder = _write(Path(tmp) / "model", plan, tensors, config, model_class, checkpoint, max_shard_size, False, False, tokenizer, conversion)
            with _progress_bars(progress):  # loading a temporary folder the caller never named: no bar unless asked
                return model_class.from_pretrained(folder).eval()
    return _write(Path(save_directory), plan, tensors, config, model_class, checkpoint, max_shard_size, overwrite, progress, tokenizer, conversion)


@contextmanager
def _progress_bars(shown: bool):
    """Transformers' progress bars as they are, or (`shown=False`) off for the block."""
    from transformers.utils import logging

    hidden = not shown and logging.is_progress_bar_enabled()
    if hidden:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if hidden:
            logging.enable_progress_bar()


def _write(target, plan, tensors, config, model_class, checkpoint, max_shard_size, overwrite, progress, tokenizer, conversion) -> Path:
    from ..modeling.common import MoEPreTrainedModel
    from ..modeling.hub_io import add_remote_code, write_custom_generate

    config.architectures = [model_class.__name__]
    with atomic_folder(target, overwrite=overwrite) as folder:
        carry_side_files(checkpoint, folder, tokenizer)
        weight_files = write_safetensors(folder, plan, tensors.get, max_shard_size, progress)
        write_checksums(folder, weight_files)
        if issubclass(model_class, MoEPreTrainedModel):  # what our save_pretrained adds
            add_remote_code(folder, model_class, config)
            write_custom_generate(folder)
        config.save_pretrained(folder)
        write_card(folder, conversion_card(conversion, config, model_class, checkpoint, folder, target.name))
    return target
