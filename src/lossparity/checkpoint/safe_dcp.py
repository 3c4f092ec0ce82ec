"""Reading a ``torch.distributed.checkpoint`` folder without running code from it.

PyTorch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load`` (any object, any code),
and a metadata entry that declares a key as bytes makes the default planner ``torch.load(...,
weights_only=False)`` that key's data. :class:`SafeFileSystemReader` reads ``.metadata`` with an unpickler
that builds only the metadata classes of ``torch.distributed.checkpoint`` (and ``torch.Size``, dtypes,
paths), and refuses byte entries: a lossparity checkpoint holds tensors only, which PyTorch reads with
``weights_only=True``. :func:`check_metadata` compares the metadata with the state to load (every key
present as a tensor of the same global shape) before any rank reads data.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ..input_files import InputFileError, read_capped
from .format import CheckpointFormatError

__all__ = ["SafeFileSystemReader", "check_metadata", "check_storage_paths", "read_metadata_safely"]

_METADATA_CLASSES = {
    "Metadata",
    "MetadataIndex",
    "ChunkStorageMetadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "TensorProperties",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}
_ALLOWED = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n) for n in _METADATA_CLASSES},
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): None,
    ("pathlib", "WindowsPath"): None,
    ("pathlib", "PurePosixPath"): None,
    ("pathlib", "PureWindowsPath"): None,
    ("collections", "OrderedDict"): None,
}


class _MetadataUnpickler(pickle._Unpickler):
    """Builds only the classes a DCP ``.metadata`` is made of; anything else raises. The pure-Python unpickler:
    its memo is a dict, where the C one sizes an array by the largest memo index a pickle names (a damaged
    ``LONG_BINPUT`` of index 2**32 allocated gigabytes)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
            from torch.distributed.checkpoint.filesystem import _StorageInfo

            return _StorageInfo
        if module == "torch.serialization" and name == "_get_layout":
            from torch.serialization import _get_layout

            return _get_layout
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)] or super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: {module}.{name} (not a checkpoint metadata class)")


def read_metadata_safely(path: str) -> dcp_metadata.Metadata:
    """The ``.metadata`` of the checkpoint folder ``path``, built without running code; raises
    :class:`CheckpointFormatError` when it needs anything beyond the metadata classes or is not one."""
    meta_path = f"{path}/.metadata"
    try:
        # unpickled from memory: a frame or string length in the pickle bounded by the bytes there (read
        # from the file, a crafted 2**60-byte frame made the unpickler allocate until the memory ran out)
        data = read_capped(meta_path, None, "a checkpoint metadata file (a regular file)")
        meta = _MetadataUnpickler(io.BytesIO(data)).load()
    except InputFileError as e:
        raise CheckpointFormatError(str(e)) from None
    except (
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        TypeError,
        ValueError,
        IndexError,
        KeyError,
        struct.error,
    ) as e:
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        raise CheckpointFormatError(f"{meta_path}: not a checkpoint metadata file ({why}); not loaded") from None
    if not isinstance(meta, dcp_metadata.Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise CheckpointFormatError(f"{meta_path}: not a checkpoint metadata object ({type(meta).__name__})")
    check_storage_paths(meta, path)
    return meta


def check_storage_paths(meta: dcp_metadata.Metadata, path: str) -> None:
    """Raise :class:`CheckpointFormatError` unless every storage entry of ``meta`` names a file inside the
    checkpoint folder ``path`` (a relative path without ``..``, not absolute, not through a link that
    leaves the folder) at a non-negative offset and length: the data of a checkpoint is never read from
    elsewhere."""
    storage = meta.storage_data
    if storage is None:
        return
    if not isinstance(storage, dict):
        raise CheckpointFormatError(f"{path}/.metadata: storage data is a {type(storage).__name__}, not a dict")
    root = os.path.realpath(path)
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
            raise CheckpointFormatError(
                f"{path}/.metadata: storage path {rel!r} is not a file name inside the checkpoint folder; not loaded"
            )
        full = os.path.realpath(os.path.join(path, rel))
        if os.path.commonpath([root, full]) != root:
            raise CheckpointFormatError(
                f"{path}/.metadata: storage path {rel!r} leads outside the checkpoint folder; not loaded"
            )
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (offset, length)):
            raise CheckpointFormatError(
                f"{path}/.metadata: storage of {rel!r} at offset {offset!r}, length {length!r}; expected integers >= 0"
            )


def check_metadata(meta: dcp_metadata.Metadata, flat_shapes: dict[str, tuple[int, ...]], path: str) -> None:
    """Raise :class:`CheckpointFormatError` unless every entry of the metadata is a tensor and every key of
    ``flat_shapes`` (the flattened state to load: ``model.<fqn>``, ``optim.state.<fqn>.<key>``, ...) is
    in it with that global shape."""
    entries = meta.state_dict_metadata
    for key, md in entries.items():
        if not isinstance(md, dcp_metadata.TensorStorageMetadata):
            raise CheckpointFormatError(f"{path}: entry {key!r} is not a tensor ({type(md).__name__}); not loaded")
    for key, shape in flat_shapes.items():
        found = entries.get(key)
        if found is None:
            raise CheckpointFormatError(f"{path}: entry {key!r} of the model's state is missing")
        assert isinstance(found, dcp_metadata.TensorStorageMetadata)
        if tuple(found.size) != shape:
            raise CheckpointFormatError(
                f"{path}: entry {key!r} has shape {list(found.size)}, the model's is {list(shape)}"
            )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_metadata_safely` and which refuses byte
    entries (PyTorch would unpickle them without ``weights_only``); tensors are read as PyTorch does, with
    ``weights_only=True``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointFormatError(f"{self.path}: per-rank metadata files are not used by lossparity")
        meta = read_metadata_safely(str(self.path))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dcp_metadata.StorageMeta()
        assert meta.storage_meta is not None
        meta.storage_meta.load_id = self.load_id
        return meta

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointFormatError(
                    f"{self.path}: entry {item.dest_index.fqn!r} is stored as bytes; not loaded"
                )
        return super().read_data(plan, planner)
