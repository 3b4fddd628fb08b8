"""What a checkpoint's files must satisfy before their tensors reach a model:

- every file read lies inside the checkpoint's folder (`check_inside`): a shard index naming `../x`, `/abs/x`, or a
  symlink leading out of the folder is refused. A Hugging Face Hub cache snapshot (`.../snapshots/REV/`, whose files
  link to `../../blobs/`) counts its repository's `blobs/` as inside.
- the bytes are those that were saved (`write_checksums` / `verify_checksums`): a `checksums.sha256` file in
  `sha256sum` format records the SHA-256 of every weight file when it is written and is checked when it is read
  (also with `sha256sum -c checksums.sha256`). Files are hashed in 1 MiB blocks, several at a time.
  For a safetensors file it also records, on a `# safetensors-header SHA256  NAME` line (a comment to sha256sum), the
  SHA-256 of its header (the tensors' names, dtypes, shapes and places). That tells a damaged file from one written
  anew on purpose: a file cut short, or whose bytes changed under the same header, is refused; a complete
  safetensors file with another header (a tool or a test that rewrote the weights with `safetensors.save_file`, or
  re-sharded them) is loaded with a warning. An edit that keeps the header (new values for the same tensors) is
  refused like damage: save the folder again (`save_pretrained` records new checksums), delete `checksums.sha256`,
  or load with `from_pretrained(..., verify_checksums=False)`.
- the stored tensors fit the model (`check_stored_dtypes`, `check_finite`): no integer or boolean tensor where the
  model has a floating-point one (loading would cast it silently), no NaN or infinity.

Standard library, torch and safetensors only: the model code carries this module into checkpoints for
`trust_remote_code`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open

CHECKSUMS_FILE = "checksums.sha256"
# the files that hold a checkpoint's weights: model.safetensors, model-00001-of-00002.safetensors, the index, a
# variant (model.fp16.safetensors), the .bin equivalents
WEIGHT_FILE = re.compile(r"^(model|pytorch_model)(\.\w+)?(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_MANIFEST_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$", flags=re.MULTILINE)  # sha256sum's text and binary modes
_HEADER_LINE = re.compile(r"^# safetensors-header ([0-9a-f]{64})  (.+)$", flags=re.MULTILINE)
logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint's files are unsafe to read or do not hold what was saved; the message names the file or tensor
    and what to do."""


def _allowed_roots(folder: Path) -> list[Path]:
    root = Path(os.path.realpath(folder))
    roots = [root]
    if Path(os.path.abspath(folder)).parent.name == "snapshots":  # the Hub cache: snapshots/REV/* -> ../../blobs/*
        roots.append(Path(os.path.realpath(Path(os.path.abspath(folder)).parent.parent / "blobs")))
    return roots


def check_inside(folder: str | os.PathLike, names: Iterable[str], what: str = "file") -> None:
    """Refuse any of `names` (relative to `folder`) that is absolute, climbs out with `..`, or is a symlink whose
    target lies outside `folder`."""
    folder = Path(folder)
    roots = _allowed_roots(folder)
    for name in names:
        name = os.fspath(name)
        real = Path(os.path.realpath(folder / name))
        if os.path.isabs(name) or ".." in Path(name).parts or not any(real.is_relative_to(r) for r in roots):
            raise CheckpointError(
                f"{folder}: the {what} {name!r} leads outside the checkpoint folder (to {real}). Checkpoints may only "
                "read files inside their folder; if the folder is yours, copy the file in (cp -L) and name it relative "
                "to the folder."
            )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)  # releases the GIL for large blocks: files hash in parallel threads
    return digest.hexdigest()


def _hash_all(folder: Path, names: list[str]) -> dict[str, str]:
    workers = min(len(names), os.cpu_count() or 1, 8) or 1
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(names, pool.map(lambda n: _sha256(folder / n), names)))


def _safetensors_header(path: Path) -> bytes | None:
    """The header of a complete safetensors file (its length and JSON), or None: not safetensors, or cut short."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = struct.unpack("<Q", f.read(8))[0]
            if length > size:
                return None
            header = f.read(length)
        entries = json.loads(header)
        end = max((v["data_offsets"][1] for k, v in entries.items() if k != "__metadata__"), default=0)
    except (OSError, struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    return struct.pack("<Q", length) + header if size == 8 + length + end else None


def check_complete(path: str | os.PathLike) -> None:
    """Refuse a safetensors file that is cut short or whose header cannot be read (an interrupted save, copy or
    download), naming the file and the fix, whether or not its folder has a `checksums.sha256`: safetensors itself
    says only "invalid header length" and not which file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            length = struct.unpack("<Q", f.read(8))[0] if size >= 8 else None
            header = f.read(length) if length is not None and length <= size - 8 else None
        entries = json.loads(header) if header is not None else None
        end = max((v["data_offsets"][1] for k, v in entries.items() if k != "__metadata__"), default=0)
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({err.strerror or err}); check that it exists and is readable.") from err
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        end = None
    fix = ("Save, copy or download it again (or restore it from a backup); where its folder has "
           f"{CHECKSUMS_FILE}, `sha256sum -c {CHECKSUMS_FILE}` there shows which files are intact.")
    if end is None:
        raise CheckpointError(f"{path} is not a complete safetensors file: its header cannot be read ({size} bytes; "
                              f"cut short, or not safetensors). {fix}")
    if size < 8 + length + end:
        raise CheckpointError(f"{path} is cut short: its header describes {8 + length + end} bytes, the file has "
                              f"{size} (an interrupted save, copy or download). {fix}")


def write_checksums(folder: str | os.PathLike, names: Iterable[str]) -> None:
    """Record the SHA-256 of `names` (files in `folder`), and of the headers of the safetensors files among them, in
    `folder/checksums.sha256`."""
    folder = Path(folder)
    digests = _hash_all(folder, sorted(names))
    lines = []
    for name, digest in digests.items():
        lines.append(f"{digest}  {name}\n")
        header = _safetensors_header(folder / name) if name.endswith(".safetensors") else None
        if header is not None:
            lines.append(f"# safetensors-header {hashlib.sha256(header).hexdigest()}  {name}\n")
    (folder / CHECKSUMS_FILE).write_text("".join(lines))


def _written_anew(path: Path, recorded_header: str | None) -> bool:
    """Whether `path` is a complete safetensors file whose header is not the one recorded when it was saved."""
    header = _safetensors_header(path)
    return header is not None and hashlib.sha256(header).hexdigest() != recorded_header


def verify_checksums(folder: str | os.PathLike, names: Iterable[str]) -> bool:
    """Compare the files `names` of `folder` with `checksums.sha256`; False when the folder has none. Raises
    CheckpointError naming the first file that differs or was not recorded."""
    folder = Path(folder)
    manifest = folder / CHECKSUMS_FILE
    if not manifest.is_file():
        return False
    text = manifest.read_text()
    recorded = {name: digest for digest, name in _MANIFEST_LINE.findall(text)}
    headers = {name: digest for digest, name in _HEADER_LINE.findall(text)}
    names = sorted(set(names))
    # a manifest without header lines (written before they were recorded) tells no rewrite from damage
    rewritten = [n for n in names if headers and n.endswith(".safetensors") and _written_anew(folder / n, headers.get(n))]
    unrecorded = [n for n in names if n not in recorded and n not in rewritten]
    if unrecorded:
        raise CheckpointError(
            f"{folder / unrecorded[0]} is read as part of the checkpoint but {manifest} does not list it: the folder "
            f"was changed after it was saved. Save it again, or delete {CHECKSUMS_FILE} if the change was yours."
        )
    for name, digest in _hash_all(folder, [n for n in names if n not in rewritten]).items():
        if digest != recorded[name]:
            raise CheckpointError(
                f"{folder / name} is not the file that was saved: its SHA-256 differs from the one in {manifest}, so "
                "its bytes were overwritten or damaged. Restore it from a backup or an earlier checkpoint (or download "
                f"it again); if you changed it on purpose, save the folder again or delete {CHECKSUMS_FILE}."
            )
    for name in rewritten:
        logger.warning(
            f"{folder / name} was written anew after {manifest} (a complete safetensors file with other tensors than "
            "were saved), so its checksum is not checked. Save the folder again to record it."
        )
    return True


def stored_dtypes(files: Iterable[str | os.PathLike]) -> dict[str, tuple[str, torch.dtype]]:
    """Tensor name -> (file, dtype) from the headers of safetensors files (no tensor data is read); a file cut short
    is refused (`check_complete`)."""
    stored = {}
    for file in files:
        check_complete(file)
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                code = handle.get_slice(key).get_dtype()
                if code in TORCH_DTYPES:
                    stored[key] = (str(file), TORCH_DTYPES[code])
    return stored


def check_stored_dtypes(stored: Mapping[str, tuple[str, torch.dtype]], expected: Mapping[str, torch.Tensor]) -> None:
    """stored: tensor name -> (file, dtype) as saved; expected: the model's tensors by name. A floating-point tensor
    of the model stored as integers or booleans (or the reverse) would be cast silently on loading: refuse it."""
    for name, (file, dtype) in stored.items():
        tensor = expected.get(name)
        if tensor is not None and tensor.dtype.is_floating_point != dtype.is_floating_point:
            raise CheckpointError(
                f"{file}: tensor {name} is stored as {dtype} but the model's is {tensor.dtype}; loading would cast "
                "its values silently. The file does not hold this model's weights: re-save or re-convert the checkpoint."
            )


def _finite(tensor: torch.Tensor) -> bool:
    # a finite sum means finite elements (NaN and infinity propagate); a sum is one vectorized pass without a
    # tensor-sized temporary, several times faster than isfinite().all(), which only decides when the sum is not
    # finite (an overflow of finite values)
    total = tensor.sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32)
    return bool(torch.isfinite(total)) or bool(torch.isfinite(tensor).all())


def check_finite(tensors: Iterable[tuple[str, str, torch.Tensor]]) -> None:
    """Refuse NaN or infinity in floating-point tensors, given as (file, name, tensor) as loaded from `file`."""
    for file, name, tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a split tensor: this process's part
        if local.is_floating_point() and type(local) not in (torch.Tensor, torch.nn.Parameter):
            local = local.dequantize()  # a quantized tensor subclass (torchao's): the values it stands for
        if local.is_floating_point() and local.device.type != "meta" and not _finite(local):
            raise CheckpointError(
                f"{file}: tensor {name} holds NaN or infinite values. The checkpoint was saved from a diverged run or "
                "damaged afterwards; load an earlier checkpoint."
            )
