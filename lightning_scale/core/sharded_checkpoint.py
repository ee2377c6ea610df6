"""Every rank saves and loads only what it holds, with ``torch.distributed.checkpoint`` (DCP), in the
committed, verifiable directory format of :mod:`lightning_scale.core.checkpoint_format`.

Save: every rank writes its shards with DCP's ``FileSystemWriter`` into the staging directory and
hashes the files it wrote (DCP names them ``__<rank>_<n>.distcp``; rank 0 also writes
``.metadata``); rank 0 gathers the entries, writes the manifest and renames the directory into
place; a barrier ends it on every rank. Load: the checkpoint is verified first (rank 0 checks the
checksums, every rank the files and sizes; a failure is raised on every rank, naming the file), then
DCP reads into the caller's state dict, resharding to whatever layout it describes.

Collectives: with a process group every rank must call these, with the same arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from lightning_scale.core.checkpoint_format import (
    CheckpointCorruptError,
    commit,
    file_entries,
    staging_dir,
    verify,
    write_manifest,
)

__all__ = ["load_sharded", "save_sharded"]


def _distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def save_sharded(
    final: Path, state: dict[str, Any], *, metadata: Mapping[str, Any], token: str, group: dist.ProcessGroup | None = None
) -> Path:
    """Write ``state`` (tensors, DTensors and plain values; each rank its own part) as the committed
    checkpoint directory ``final``. ``token`` names the staging directory: the same on every rank."""
    final = Path(final)
    staging = staging_dir(final, token)
    distributed = _distributed(group)
    rank = dist.get_rank(group) if distributed else 0
    staging.mkdir(parents=True, exist_ok=True)
    dcp.save(state, storage_writer=FileSystemWriter(staging, sync_files=True), process_group=group, no_dist=not distributed)
    mine = sorted(p.name for p in staging.glob(f"__{rank}_*"))
    if rank == 0:
        mine.append(".metadata")
    entries = file_entries(staging, mine)
    if distributed:
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, entries, group=group)
        entries = [e for part in everyone for e in part]
    if rank == 0:
        write_manifest(staging, entries, metadata)
        commit(staging, final)
    if distributed:
        dist.barrier(group=group)
    return final


def load_sharded(path: Path, state: dict[str, Any], *, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Verify the checkpoint at ``path``, then load it into ``state`` in place (DCP: each rank reads
    what its tensors' shards need). Returns the manifest."""
    path = Path(path)
    distributed = _distributed(group)
    rank = dist.get_rank(group) if distributed else 0
    problem = ""
    manifest: dict[str, Any] = {}
    try:
        manifest = verify(path, checksums=rank == 0)
    except CheckpointCorruptError as err:
        problem = str(err)
    if distributed:
        problems: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
        problem = next((p for p in problems if p), "")
    if problem:
        raise CheckpointCorruptError(problem)
    dcp.load(state, storage_reader=FileSystemReader(path), process_group=group, no_dist=not distributed)
    return manifest
