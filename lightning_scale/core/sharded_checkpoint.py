"""Every rank saves and loads only what it holds, with ``torch.distributed.checkpoint`` (DCP), in the
committed, verifiable directory format of :mod:`lightning_scale.core.checkpoint_format`.

Save: every rank writes its shards with DCP's ``FileSystemWriter`` into the staging directory, then
its own small files (JSON), and hashes what it wrote (DCP names its files ``__<rank>_<n>.distcp``;
rank 0 also writes ``.metadata``); the entries (or the error a rank met) are gathered, rank 0 writes
the manifest and renames the directory into place, and a barrier ends it. A failure on any rank is
raised on every rank and leaves no directory under the final name. Load: the checkpoint is verified
first (every rank checksums a share of the files), then DCP reads into the caller's tensors,
resharding to whatever layout they describe.

Safety: DCP's reader unpickles ``.metadata`` and any non-tensor item; here the metadata is read
with an unpickler that knows only DCP's metadata classes, and a non-tensor item is refused, so
loading a checkpoint runs no code its author chose.

Collectives: with a process group every rank must call these, with the same arguments.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_scale.core.checkpoint_format import (
    CheckpointCorruptError,
    commit,
    file_entries,
    staging_dir,
    verify,
    write_manifest,
)

__all__ = [
    "SafeFileSystemReader",
    "StagingWriter",
    "TensorsOnlyLoadPlanner",
    "distributed",
    "load_sharded",
    "read_tensor_metadata",
    "save_sharded",
    "verify_distributed",
]

_METADATA = ".metadata"
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Only what DCP's ``Metadata`` is made of: its own dataclasses, sizes, dtypes and layouts."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointCorruptError(
            f"The checkpoint's DCP metadata refers to {module}.{name}, which DCP metadata never holds: refusing to "
            "unpickle it (a checkpoint must not run code when it is loaded)."
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose metadata is read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointCorruptError(f"{path} does not hold DCP metadata.")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, refusing the pickled (non-tensor) items DCP would otherwise unpickle."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointCorruptError(
            f"The checkpoint stores {read_item.dest_index.fqn!r} as pickled bytes; lightning-scale loads tensors only "
            "from shards (other state is JSON)."
        )


def distributed(group: dist.ProcessGroup | None) -> bool:
    """True when ``group`` (None: the world) spans more than this process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if distributed(group) else 0


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if distributed(group) else 1


def _gather(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    if not distributed(group):
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_tensor_metadata(path: Path) -> dict[str, TensorStorageMetadata]:
    """Every tensor a DCP checkpoint holds: its key, global size and dtype (``.properties.dtype``)."""
    metadata = SafeFileSystemReader(path).read_metadata()
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


class StagingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` whose :meth:`stage` copies a state dict into host buffers kept from the
    previous save (DCP's cached staging), pinned only where CUDA can pin, rebuilt when the tensors change."""

    def __init__(self, *, thread_count: int = 1) -> None:
        super().__init__(".", sync_files=True, thread_count=thread_count, cache_staged_state_dict=True)
        self._layout: list[tuple[str, tuple[int, ...], torch.dtype, type]] | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = [(k, tuple(v.shape), v.dtype, type(v)) for k, v in state_dict.items()]
        if self.state_dict_cache is None or layout != self._layout:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._layout = layout
        return _copy_state_dict(state_dict, self.state_dict_cache)


def save_sharded(
    final: Path,
    tensors: Mapping[str, Tensor],
    *,
    files: Mapping[str, bytes] | None = None,
    metadata: Mapping[str, Any],
    token: str,
    group: dist.ProcessGroup | None = None,
    thread_count: int = 1,
    writer: FileSystemWriter | None = None,
) -> Path:
    """Write ``tensors`` (flat keys; tensors and DTensors, each rank its own part: a key several ranks
    hold as a plain tensor is written once) and this rank's ``files`` (name -> bytes; names unique
    across ranks) as the committed checkpoint directory ``final``. ``token``: the same on every rank.
    ``writer``: a DCP writer to reuse (its path is reset to the staging directory)."""
    final = Path(final)
    staging = staging_dir(final, token)
    multi = distributed(group)
    staging.mkdir(parents=True, exist_ok=True)
    if writer is None:
        writer = FileSystemWriter(staging, sync_files=True, thread_count=thread_count)
    try:
        dcp.save(dict(tensors), checkpoint_id=staging, storage_writer=writer, process_group=group, no_dist=not multi)
    except CheckpointException as err:
        # DCP gathers every rank's write result and raises on all of them (a BaseException: made an OSError).
        if _rank(group) == 0:
            shutil.rmtree(staging, ignore_errors=True)
        failures = "; ".join(f"rank {r}: {_describe(e)}" for r, e in sorted(err.failures.items()))
        raise OSError(f"Saving the checkpoint {final} failed; earlier checkpoints are untouched. {failures}") from None
    except BaseException:
        if _rank(group) == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return finish_sharded(staging, final, files=files, metadata=metadata, group=group)


def _describe(failure: Any) -> str:
    error = failure[0] if isinstance(failure, tuple) else failure  # DCP wraps (exception, traceback)
    return f"{type(error).__name__}: {error}"


def finish_sharded(
    staging: Path,
    final: Path,
    *,
    files: Mapping[str, bytes] | None,
    metadata: Mapping[str, Any],
    group: dist.ProcessGroup | None,
) -> Path:
    """After DCP wrote ``staging`` on every rank: this rank's own files, the hashes, the manifest and the commit."""
    rank = _rank(group)
    result: Any
    try:
        for name, data in (files or {}).items():
            _write_file(staging / name, data)
        mine = sorted(p.name for p in staging.glob(f"__{rank}_*")) + list(files or {})
        if rank == 0:
            mine.append(_METADATA)
        result = file_entries(staging, mine)
    except Exception as err:  # noqa: BLE001 - reported on every rank below
        result = f"rank {rank}: {type(err).__name__}: {err}"
    everyone = _gather(result, group)
    problems = [r for r in everyone if isinstance(r, str)]
    if not problems and rank == 0:
        try:
            write_manifest(staging, [e for part in everyone for e in part], metadata)
            commit(staging, final)
        except Exception as err:  # noqa: BLE001
            problems.append(f"rank 0: {type(err).__name__}: {err}")
    problems = _gather(problems, group)[0]  # rank 0's list: everybody's, and its own commit's
    if problems:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise OSError(f"Saving the checkpoint {final} failed; earlier checkpoints are untouched. " + "; ".join(problems))
    return final


def verify_distributed(path: Path, *, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """:func:`verify` with the checksum work shared: every rank hashes every ``world``-th file and
    checks the others' presence and size. A problem found anywhere is raised on every rank."""
    path = Path(path)
    rank, world = _rank(group), _world(group)
    problem, manifest = "", {}
    try:
        # The manifest lists files sorted by path, the same on every rank.
        manifest = verify(path, checksums=lambda index, _: index % world == rank)
    except CheckpointCorruptError as err:
        problem = str(err)
    problem = next((p for p in _gather(problem, group) if p), "")
    if problem:
        raise CheckpointCorruptError(problem)
    return manifest


def _global_shape(tensor: Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)  # a DTensor's shape is the global one


def load_sharded(
    path: Path,
    state: dict[str, Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    strict: bool = True,
    verified: bool = False,
) -> list[str]:
    """Verify the checkpoint at ``path`` (unless ``verified``), then load it into ``state``'s tensors in
    place (DCP: each rank reads what its shards need, from any layout; dtypes are cast). Returns the
    keys of ``state`` the checkpoint lacks (``strict``: a ``KeyError`` naming them instead); a shape
    mismatch is a ``ValueError`` naming the key. Either is raised on every rank, before DCP's collectives."""
    path = Path(path)
    if not verified:
        verify_distributed(path, group=group)
    saved = read_tensor_metadata(path)
    missing = [k for k in state if k not in saved]
    problem: tuple[str, str] | None = None
    if missing and strict:
        problem = ("KeyError", (
            f"The checkpoint {path} has no {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)} entries "
            "missing). Load it into the model it was saved from, or non-strictly (LightningModule.strict_loading=False)."
        ))  # fmt: skip
    for key, tensor in state.items():
        if problem is None and key in saved and tuple(saved[key].size) != _global_shape(tensor):
            problem = ("ValueError", (
                f"{key!r} has shape {tuple(saved[key].size)} in the checkpoint {path} and {_global_shape(tensor)} "
                "here: the checkpoint is of another model configuration."
            ))  # fmt: skip
    problem = next((p for p in _gather(problem, group) if p is not None), None)
    if problem is not None:
        raise (KeyError if problem[0] == "KeyError" else ValueError)(problem[1])
    request = {k: v for k, v in state.items() if k in saved}
    dcp.load(
        request,
        storage_reader=SafeFileSystemReader(path),
        planner=TensorsOnlyLoadPlanner(allow_partial_load=True),
        process_group=group,
        no_dist=not distributed(group),
    )
    return missing


def full_tensors_from(path: Path, keys: list[str] | None = None) -> dict[str, Tensor]:
    """Whole (unsharded) CPU tensors for ``keys`` (None: all) of a checkpoint, read in this process alone."""
    saved = read_tensor_metadata(path)
    keys = list(saved) if keys is None else keys
    out = {k: torch.empty(tuple(saved[k].size), dtype=saved[k].properties.dtype) for k in keys}
    if out:
        dcp.load(
            out,
            storage_reader=SafeFileSystemReader(path),
            planner=TensorsOnlyLoadPlanner(allow_partial_load=False),
            no_dist=True,
        )
    return out
