"""Reading checkpoints lazily and writing converted ones as they are computed.

- `open_checkpoint` reads a model object or a folder of safetensors (as written by Transformers) into a `Checkpoint`:
  its config and a `TensorSource` that opens tensors with `safe_open` only when asked for.
- `write_safetensors` writes sharded safetensors one tensor at a time: shard sizes and file headers are planned from
  shapes alone (a meta pass), then each tensor is computed, written and freed, so a conversion holds about one
  tensor of the output in memory, never a whole copy.
- Outputs are written with `hf_ppmoe.utils.atomic.atomic_folder` (a conversion that fails or is killed half-way
  leaves no output folder, or the previous one with `overwrite`) and record their weights' SHA-256.
- What is read is checked (`hf_ppmoe.utils.integrity`): weight files and carried side files must lie inside the
  source folder, and weight files must match the source's `checksums.sha256` when it has one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..utils.integrity import (
    CHECKSUMS_FILE,
    SAFETENSORS_DTYPES,
    TORCH_DTYPES,
    CheckpointError,
    check_complete,
    check_inside,
    verify_checksums,
)
from .choices import parse_size
from .mapping import ConversionError, DictSource, TensorSource, shape_str

# files of a source folder that are not carried into the output: weights, the config (rewritten), code, checksums
_NOT_CARRIED = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".py", ".index.json", CHECKSUMS_FILE)


class SafetensorsSource(TensorSource):
    """The tensors of a folder's `model.safetensors` or `model.safetensors.index.json` shards, read lazily."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").is_file():
            weight_map = None
        else:
            found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
            raise ConversionError(
                f"{folder} has no model.safetensors or model.safetensors.index.json (found: {found}). Only safetensors "
                "checkpoints are read; re-save the model with Transformers' save_pretrained to get one."
            )
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        try:
            check_inside(folder, files, "weight file")
            verify_checksums(folder, files)
        except CheckpointError as err:
            raise ConversionError(str(err)) from err
        self._handles, self._file_of, self._meta = {}, {}, {}
        for name in files:
            path = folder / name
            try:
                check_complete(path)
            except CheckpointError as err:
                raise ConversionError(str(err)) from err
            try:
                handle = safe_open(path, framework="pt")
                for key in handle.keys():
                    sl = handle.get_slice(key)
                    self._meta[key] = (tuple(sl.get_shape()), TORCH_DTYPES[sl.get_dtype()])
                    self._file_of[key] = name
            except (SafetensorError, OSError, KeyError) as err:
                raise ConversionError(f"cannot read {path}: {err}. The file is corrupt or not a safetensors file.") from err
            self._handles[name] = handle
        if weight_map:
            absent = sorted(k for k, f in weight_map.items() if self._file_of.get(k) != f)
            if absent:
                raise ConversionError(
                    f"{index} lists tensor(s) its shards do not hold: {', '.join(absent[:8])}. The checkpoint is incomplete."
                )

    def keys(self):
        return list(self._meta)

    def get(self, name):
        try:
            return self._handles[self._file_of[name]].get_tensor(name)
        except SafetensorError as err:
            raise ConversionError(f"cannot read tensor {name} from {self.folder / self._file_of[name]}: {err}") from err

    def meta(self):
        return DictSource(
            {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in self._meta.items()},
            str(self.folder),
        )

    def describe(self, name):
        shape, _ = self._meta[name]
        return f"{name} [{', '.join(map(str, shape))}] in {self.folder / self._file_of[name]}"


@dataclass
class Checkpoint:
    """A source to convert: its config, its tensors (lazy), and where it came from (a folder or a live model)."""

    config: object
    tensors: TensorSource
    folder: Path | None = None
    model: torch.nn.Module | None = None
    source: str | None = None  # the folder or Hub id as given (for the model card's base_model)


def read_config_dict(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder} has no config.json; point to a folder written by save_pretrained.")
    return json.loads(path.read_text())


def resolve_folder(path: str | os.PathLike) -> Path:
    """A local folder, or a Hub repository id downloaded to the local cache (config, safetensors, tokenizer)."""
    folder = Path(path)
    if folder.is_dir():
        return folder
    if folder.exists():
        raise ConversionError(f"{folder} is a file; point to the model's folder.")
    local_parent = folder.parent != Path(".") and folder.parent.is_dir()  # `runs/x` with runs/ here: not a Hub id
    if folder.is_absolute() or str(path).startswith((".", "~")) or str(path).count("/") > 1 or local_parent:
        raise ConversionError(f"no such folder: {folder}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
    except Exception as err:  # offline, unknown repo, no access: all mean "not found"
        raise ConversionError(f"{path} is neither a local folder nor a Hub repository that can be downloaded ({err}).") from err


def model_tensors(model: torch.nn.Module) -> TensorSource:
    """A live model's weights under the names `save_pretrained` would write (tied copies and Transformers' load-time
    renamings undone, e.g. Mixtral's fused experts back to block_sparse_moe.experts.{e}.w1)."""
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict(keep_vars=True)
    seen, tensors = set(), {}
    for name, tensor in state.items():
        if id(tensor) in seen:  # a tied weight (lm_head = embed_tokens): saved once, like save_pretrained does
            continue
        seen.add(id(tensor))
        tensors[name] = tensor.detach()
    return DictSource(dict(revert_weight_conversion(model, tensors)), f"the {type(model).__name__} object")


def open_checkpoint(src, config_loader: Callable[[Path], object]) -> Checkpoint:
    if isinstance(src, torch.nn.Module):
        if not hasattr(src, "config"):
            raise ConversionError(f"expected a Transformers model or a folder, got a {type(src).__name__} without a config")
        return Checkpoint(src.config, model_tensors(src), model=src)
    folder = resolve_folder(src)
    config = config_loader(folder)
    return Checkpoint(config, SafetensorsSource(folder), folder=folder, source=str(src))


def write_safetensors(
    folder: Path,
    plan: list[tuple[str, torch.Size, torch.dtype]],
    get: Callable[[str], torch.Tensor],
    max_shard_size: int | str = "5GB",
    progress: bool = False,
) -> list[str]:
    """Write `plan` (name, shape, dtype) as sharded safetensors in `folder`, computing each tensor with `get` just
    before its bytes are written. Shards are cut by size as Transformers does (`model-00001-of-0000N.safetensors` and
    an index; a single `model.safetensors` when everything fits). Returns the names of the files written."""
    limit = parse_size(max_shard_size)
    shards: list[list[tuple[str, torch.Size, torch.dtype]]] = [[]]
    size = 0
    for name, shape, dtype in plan:
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, shape, dtype))
        size += nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]

    bar = None
    if progress:
        from tqdm.auto import tqdm

        # shown only once the write has taken a few seconds: a tiny conversion prints no bar
        bar = tqdm(total=len(plan), desc="writing tensors", unit="tensor", delay=3)
    weight_map, total = {}, 0
    for filename, shard in zip(names, shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype in shard:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = filename
        total += offset
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        with open(folder / filename, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for name, shape, dtype in shard:
                tensor = get(name)
                if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                    raise ConversionError(f"{name}: computed {shape_str(tensor)} {tensor.dtype}, planned {list(shape)} {dtype}")
                f.write(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
                del tensor
                if bar is not None:
                    bar.update()
    if bar is not None:
        bar.close()
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        names.append("model.safetensors.index.json")
    return names


def carry_side_files(checkpoint: Checkpoint, folder: Path, tokenizer=None) -> None:
    """Copy what makes the output folder complete: tokenizer files, generation config, license, model card. A file
    that is a symlink out of the source folder is refused (a crafted folder could otherwise copy any file the user
    can read into an output that gets shared)."""
    if checkpoint.folder is not None:
        for item in sorted(checkpoint.folder.iterdir()):
            if item.is_file() and not item.name.startswith(".") and item.name != "config.json" and not item.name.endswith(_NOT_CARRIED):
                try:
                    check_inside(checkpoint.folder, [item.name], "file")
                except CheckpointError as err:
                    raise ConversionError(f"{err} Or delete the link; it is not needed for the conversion.") from err
                shutil.copy2(item, folder / item.name)
    elif getattr(checkpoint.model, "generation_config", None) is not None:
        checkpoint.model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
