"""DCP's ``.metadata`` read without running anything a checkpoint chose, and checked against the
manifest before any shard is opened. No Lightning, no process group.

DCP stores its metadata as a pickle, and ``pickle`` resolves whatever names a file gives it: with
protocol 4 a name may be a dotted path, so an allowed module's ``os`` (``...metadata`` +
``os.system``) is one ``STACK_GLOBAL`` away. :class:`_MetadataUnpickler` therefore imports
nothing and resolves nothing: it hands out objects from :data:`_ALLOWED`, a table of exact
``(module, name)`` pairs built here from the classes DCP's metadata is made of; any other pair,
dotted or not, is refused before it is looked up.

:func:`read_metadata` reads the file only once the manifest vouches for it (listed, inside the
directory, its recorded size and checksum: the bytes unpickled are the bytes checked), then
:func:`check_metadata` checks what came out: DCP's types only, every file it points to a plain
name the manifest lists (so a load opens nothing the manifest does not vouch for), each item
inside its file, and no pickled (``BYTE_IO``) item, which lightning-scale never writes and never
loads.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from lightning_scale.core.checkpoint.format import MANIFEST, CheckpointCorruptError, listed_entries, read_listed
from lightning_scale.core.checkpoint.storage import AnyPath, as_path
from lightning_scale.core.compat import (
    DCP_METADATA_FILE,
    TORCH_LAYOUT_PICKLE_NAME,
    dcp_memory_format_encoding,
    dcp_storage_info_type,
)

__all__ = ["METADATA", "check_metadata", "read_metadata", "unpickle_metadata"]

METADATA = DCP_METADATA_FILE

_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: Any) -> torch.layout:
    """What torch's own rebuild function (``TORCH_LAYOUT_PICKLE_NAME``) does for DCP's ``TensorProperties.layout``,
    from a fixed table."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise CheckpointCorruptError(f"unknown tensor layout {name!r}")
    return _LAYOUTS[name]


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_STORAGE_INFO = dcp_storage_info_type()
# Exactly what a DCP ``.metadata`` pickle names (torch 2.x), each mapped to the object it gets. No
# module is imported and no attribute looked up at load time: a pair not here is refused. The private
# ones come from lightning_scale.core.compat.
_ALLOWED: dict[tuple[str, str], Any] = {
    **{
        (_METADATA_MODULE, cls.__name__): cls
        for cls in (
            Metadata,
            MetadataIndex,
            StorageMeta,
            TensorProperties,
            TensorStorageMetadata,
            ChunkStorageMetadata,
            BytesStorageMetadata,  # unpickled so that it can be refused by name (check_metadata)
            dcp_memory_format_encoding(),
        )
    },
    (_STORAGE_INFO.__module__, _STORAGE_INFO.__qualname__): _STORAGE_INFO,
    ("torch", "Size"): torch.Size,
    TORCH_LAYOUT_PICKLE_NAME: _layout,
    **{("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)},
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    # StorageMeta.checkpoint_id: a path (``pathlib._local`` is where Python 3.13 defines them).
    **{
        (module, cls.__name__): cls
        for module in ("pathlib", "pathlib._local")
        for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PureWindowsPath)
    },
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        # Never super().find_class: it imports ``module`` and follows a dotted ``name`` attribute by attribute.
        found = _ALLOWED.get((module, name))
        if found is None:
            raise CheckpointCorruptError(
                f"{self.where} refers to {module}.{name}, which is not one of the classes DCP metadata is made of: "
                "refusing to unpickle it (loading a checkpoint must never run code its author chose)."
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointCorruptError(
            f"{self.where} holds a persistent reference ({pid!r}), which DCP metadata never has."
        )


def unpickle_metadata(data: bytes, where: str) -> Metadata:
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file (``where`` names it in errors), by
    :class:`_MetadataUnpickler`. Checks nothing else: see :func:`check_metadata`."""
    try:
        metadata = _MetadataUnpickler(data, where).load()
    except CheckpointCorruptError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever a damaged pickle raises: one error naming the file
        raise CheckpointCorruptError(f"{where} is not readable DCP metadata ({type(err).__name__}: {err}).") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{where} holds a {type(metadata).__name__}, not DCP metadata.")
    return metadata


def check_metadata(metadata: Metadata, manifest: Mapping[str, Any], where: str) -> None:
    """Refuse DCP metadata a lightning-scale load must not follow (``CheckpointCorruptError`` naming
    ``where`` and the rule): an item stored pickled (``BYTE_IO``), a type DCP does not use, a file
    that is not a plain name listed in the ``manifest`` (its checksum is what vouches for the
    file), an item reaching past its file's recorded size."""
    try:
        _check(metadata, manifest, where)
    except (AttributeError, TypeError, ValueError) as err:  # objects built without their fields, odd values
        raise CheckpointCorruptError(
            f"{where} is not well-formed DCP metadata ({type(err).__name__}: {err})."
        ) from None


def _check(metadata: Metadata, manifest: Mapping[str, Any], where: str) -> None:
    items = metadata.state_dict_metadata
    if not isinstance(items, dict):
        raise CheckpointCorruptError(f"{where} has no table of stored items.")
    for key, value in items.items():
        if isinstance(value, BytesStorageMetadata):
            raise CheckpointCorruptError(
                f"{where} stores {key!r} as a pickled (BYTE_IO) item; lightning-scale checkpoints hold tensors only "
                "(other state is JSON) and never unpickle an item: re-save it as a tensor."
            )
        if not isinstance(key, str) or not _is_tensor_entry(value):
            raise CheckpointCorruptError(
                f"{where} describes {key!r} with a {type(value).__name__}, not a tensor's metadata."
            )
    files = listed_entries(manifest)
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointCorruptError(f"{where} has no table of where its items are stored.")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _STORAGE_INFO):
            raise CheckpointCorruptError(f"{where} has a storage entry of type {type(info).__name__}.")
        name = info.relative_path
        if not isinstance(name, str) or not name:
            raise CheckpointCorruptError(f"{where} stores {index.fqn!r} in {name!r}, which is not a file name.")
        pure = PurePosixPath(name)
        if pure.is_absolute() or ".." in pure.parts or "\\" in name:
            raise CheckpointCorruptError(
                f"{where} stores {index.fqn!r} in {name!r}, a path outside the checkpoint directory: a load reads only "
                "the files of its own directory."
            )
        entry = files.get(name)
        if entry is None:
            raise CheckpointCorruptError(
                f"{where} stores {index.fqn!r} in {name!r}, which {MANIFEST} does not list: a load reads only files the "
                "manifest vouches for with a checksum."
            )
        offset, length = info.offset, info.length
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
            raise CheckpointCorruptError(f"{where} stores {index.fqn!r} at offset={offset!r}, length={length!r}.")
        if not isinstance(entry.get("bytes"), int) or offset + length > entry["bytes"]:
            raise CheckpointCorruptError(
                f"{where} stores {index.fqn!r} at bytes {offset}-{offset + length} of {name}, which has {entry['bytes']}."
            )
        transforms = info.transform_descriptors
        if transforms is not None and not (
            isinstance(transforms, (list, tuple)) and all(isinstance(t, str) for t in transforms)
        ):
            raise CheckpointCorruptError(f"{where} gives {index.fqn!r} the stream transforms {transforms!r}.")


def _is_tensor_entry(value: Any) -> bool:
    if not isinstance(value, TensorStorageMetadata) or not isinstance(value.size, torch.Size):
        return False
    properties = value.properties
    return (
        isinstance(properties, TensorProperties)
        and isinstance(properties.dtype, torch.dtype)
        and isinstance(value.chunks, list)
        and all(isinstance(c, ChunkStorageMetadata) for c in value.chunks)
    )


def read_metadata(path: AnyPath, manifest: Mapping[str, Any], *, name: str = METADATA) -> Metadata:
    """The checkpoint's DCP metadata, read only if the ``manifest`` lists it (its size and checksum
    checked on the bytes that are then unpickled), by :func:`unpickle_metadata`, then checked by
    :func:`check_metadata`. Any failure is a ``CheckpointCorruptError`` naming the file and the rule."""
    path = as_path(path)
    where = str(path / name)
    metadata = unpickle_metadata(read_listed(path, manifest, name), where)
    check_metadata(metadata, manifest, where)
    return metadata
