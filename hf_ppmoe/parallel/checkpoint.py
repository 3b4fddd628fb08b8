"""Reading torch.distributed.checkpoint (DCP) folders without running code stored in them.

DCP (torch 2.13) reads a checkpoint's `.metadata` with `pickle.load`, and its non-tensor entries (an optimizer's
hyper-parameters) with `torch.load(weights_only=False)`, so a crafted checkpoint executes code on every rank that
loads it. `load_distributed_checkpoint` reads the same folders with a restricted unpickler that admits only the
classes DCP writes into `.metadata` (the Metadata record, tensor and chunk descriptions, sizes, dtypes, layouts,
paths) and with `torch.load(weights_only=True)` for the other entries: what Accelerate does for the single-process
checkpoint's files. Anything else is refused with an error naming the file and the class.
"""

from __future__ import annotations

import io
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

_METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided, ...)
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
    ("collections", "OrderedDict"),
}


class UntrustedCheckpointError(ValueError):
    """A checkpoint holds pickled objects that loading would have to execute."""


def _refusal(path, what: str) -> UntrustedCheckpointError:
    return UntrustedCheckpointError(
        f"{path}: refusing to unpickle {what}. A torch.distributed checkpoint written by this training holds only "
        "tensors, their descriptions and plain values; anything else could run code when loaded. This checkpoint was "
        "written by something else or altered: resume from another checkpoint."
    )


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


class _Reader(FileSystemReader):
    refusal = None

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as error:
                self.refusal = _refusal(path, f"{error} from the checkpoint's metadata")
                raise self.refusal from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _Planner(DefaultLoadPlanner):
    refusal = None

    def __init__(self, path):
        super().__init__()
        self.path = path

    def load_bytes(self, read_item, value):
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            self.refusal = _refusal(self.path, f"entry {read_item.dest_index.fqn} ({str(error).splitlines()[0]})")
            raise self.refusal from None
        safe = io.BytesIO()  # DCP's own load_bytes unpickles fully: hand it the checked value, serialized by us
        torch.save(loaded, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


def load_distributed_checkpoint(state_dict: dict, path: str | os.PathLike) -> None:
    """`torch.distributed.checkpoint.load(state_dict, checkpoint_id=path)` without executing pickled code; raises
    UntrustedCheckpointError for a checkpoint that would need it."""
    reader, planner = _Reader(path), _Planner(path)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner)
    except BaseException as error:  # DCP wraps a failure in a CheckpointException (a BaseException): say it plainly
        refusal = reader.refusal or planner.refusal
        if refusal is None:
            raise
        raise refusal from error
