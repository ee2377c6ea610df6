"""Every rank saves and loads only what it holds, with ``torch.distributed.checkpoint`` (DCP), in the
committed, verifiable directory format of :mod:`lightning_scale.core.checkpoint.format`.

Save: every rank writes its shards with DCP's ``FileSystemWriter`` into the staging directory, then
its own small files (JSON), and hashes what it wrote (DCP names its files ``__<rank>_<n>.distcp``;
rank 0 also writes ``.metadata``); the entries (or the error a rank met) are gathered, rank 0 writes
the manifest and renames the directory into place, and a barrier ends it. A failure on any rank is
raised on every rank and leaves no directory under the final name. Load: the checkpoint is verified
first (every rank checksums a share of the files), then DCP reads into the caller's tensors,
resharding to whatever layout they describe.

Safety: DCP's reader unpickles ``.metadata`` and any non-tensor item; here the metadata is read
only once the manifest vouches for it, by an unpickler that resolves nothing but DCP's own classes,
and checked before use (:mod:`lightning_scale.core.checkpoint.dcp_metadata`): a non-tensor item is refused and
every file it names must be listed in the manifest. Loading a checkpoint runs no code its author
chose and opens no file its manifest does not vouch for.

Collectives: with a process group every rank must call these, with the same arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_scale.core.checkpoint.checksums import DEFAULT_CHECKSUM, check_checksum
from lightning_scale.core.checkpoint.commit import clear_in_place, commit, file_entries, staging_dir, write_manifest
from lightning_scale.core.checkpoint.dcp_metadata import METADATA, read_metadata
from lightning_scale.core.checkpoint.format import CheckpointCorruptError, is_shard_file, read_manifest, verify
from lightning_scale.core.checkpoint.shard_reader import (
    SafeFileSystemReader,
    ShardReader,
    TensorsOnlyLoadPlanner,
    dcp_id,
)
from lightning_scale.core.checkpoint.shard_writer import StagingWriter
from lightning_scale.core.checkpoint.storage import AnyPath, as_path, rmtree, write_durable
from lightning_scale.core.parallel.groups import distributed, gather_objects, group_rank, group_size

__all__ = [
    "SafeFileSystemReader",
    "StagingWriter",
    "TensorsOnlyLoadPlanner",
    "distributed",
    "load_sharded",
    "read_tensor_metadata",
    "tensor_entries",
    "check_unhashed",
    "full_tensors_from",
    "save_sharded",
    "verify_distributed",
]


def read_tensor_metadata(path: AnyPath, manifest: Mapping[str, Any] | None = None) -> dict[str, TensorStorageMetadata]:
    """Every tensor a DCP checkpoint holds: its key, global size and dtype (``.properties.dtype``),
    from its metadata read safely (:func:`~lightning_scale.core.checkpoint.dcp_metadata.read_metadata`;
    ``manifest``: the checkpoint's, read already)."""
    return tensor_entries(SafeFileSystemReader(path, manifest=manifest).read_metadata())


def tensor_entries(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def save_sharded(
    final: AnyPath,
    tensors: Mapping[str, Tensor],
    *,
    files: Mapping[str, bytes] | None = None,
    metadata: Mapping[str, Any],
    token: str,
    group: dist.ProcessGroup | None = None,
    thread_count: int = 1,
    writer: FileSystemWriter | None = None,
    checksum: str = DEFAULT_CHECKSUM,
) -> AnyPath:
    """Write ``tensors`` (flat keys; tensors and DTensors, each rank its own part: a key several ranks
    hold as a plain tensor is written once) and this rank's ``files`` (name -> bytes; names unique
    across ranks) as the committed checkpoint directory ``final``. ``token``: the same on every rank.
    ``writer``: a DCP writer to reuse (its path is reset to the staging directory). ``checksum``: the
    manifest's algorithm, one of ``CHECKSUMS`` (a :class:`StagingWriter` hashes with it as it writes)."""
    checksum = check_checksum(checksum)
    stray = [k for k, v in tensors.items() if not isinstance(v, Tensor)]
    if stray:
        # DCP would pickle them (BYTE_IO items), which no lightning-scale load reads.
        raise TypeError(
            f"save_sharded stores tensors only; {stray[:5]} are {type(tensors[stray[0]]).__name__}s. Store other "
            "state as a file (files=...) or as a tensor."
        )
    final = as_path(final)
    staging = staging_dir(final, token)
    multi = distributed(group)
    if staging == final:  # written in place (object stores): an older checkpoint of this name goes first,
        if group_rank(group) == 0:
            clear_in_place(final)
        gather_objects(None, group)  # and nobody writes before it is gone
    staging.mkdir(parents=True, exist_ok=True)
    if writer is None:
        writer = StagingWriter(thread_count=thread_count, cache=False, checksum=checksum)
    elif isinstance(writer, StagingWriter):
        writer.checksum = checksum
    try:
        dcp.save(
            dict(tensors), checkpoint_id=dcp_id(staging), storage_writer=writer, process_group=group, no_dist=not multi
        )
    except CheckpointException as err:
        # DCP gathers every rank's write result and raises on all of them (a BaseException: made an OSError).
        if group_rank(group) == 0:
            rmtree(staging)
        failures = "; ".join(f"rank {r}: {_describe(e)}" for r, e in sorted(err.failures.items()))
        raise OSError(f"Saving the checkpoint {final} failed; earlier checkpoints are untouched. {failures}") from None
    except BaseException:
        if group_rank(group) == 0:
            rmtree(staging)
        raise
    digests = getattr(writer, "digests", None)
    return finish_sharded(
        staging, final, files=files, metadata=metadata, group=group, digests=digests, checksum=checksum
    )


def _describe(failure: Any) -> str:
    error = failure[0] if isinstance(failure, tuple) else failure  # DCP wraps (exception, traceback)
    return f"{type(error).__name__}: {error}"


def finish_sharded(
    staging: AnyPath,
    final: AnyPath,
    *,
    files: Mapping[str, bytes] | None,
    metadata: Mapping[str, Any],
    group: dist.ProcessGroup | None,
    digests: Mapping[str, tuple[int, str]] | None = None,
    checksum: str = DEFAULT_CHECKSUM,
) -> AnyPath:
    """After DCP wrote ``staging`` on every rank: this rank's own files, their ``checksum`` digests
    (``digests``: those taken while writing), the manifest and the commit."""
    rank = group_rank(group)
    result: Any
    try:
        for name, data in (files or {}).items():
            write_durable(staging / name, data)
        mine = sorted(p.name for p in staging.glob(f"__{rank}_*")) + list(files or {})
        if rank == 0:
            mine.append(METADATA)
        result = file_entries(staging, mine, known=digests, checksum=checksum)
    except Exception as err:  # noqa: BLE001 - reported on every rank below
        result = f"rank {rank}: {type(err).__name__}: {err}"
    everyone = gather_objects(result, group)
    problems = [r for r in everyone if isinstance(r, str)]
    if not problems and rank == 0:
        try:
            write_manifest(staging, [e for part in everyone for e in part], metadata)
            commit(staging, final)
        except Exception as err:  # noqa: BLE001
            problems.append(f"rank 0: {type(err).__name__}: {err}")
    problems = gather_objects(problems, group)[0]  # rank 0's list: everybody's, and its own commit's
    if problems:
        if rank == 0:
            rmtree(staging)
        raise OSError(
            f"Saving the checkpoint {final} failed; earlier checkpoints are untouched. " + "; ".join(problems)
        )
    return final


def verify_distributed(path: AnyPath, *, group: dist.ProcessGroup | None = None, shards: bool = True) -> dict[str, Any]:
    """:func:`verify` with the checksum work shared (every rank hashes every ``world``-th file and
    checks the others' presence and size), and DCP's metadata checked (rank 0:
    :func:`~lightning_scale.core.checkpoint.dcp_metadata.read_metadata`). A problem found anywhere is raised on
    every rank.
    ``shards=False``: the DCP data files are checked for presence and size only (a load hashes them
    as it reads them: :func:`load_sharded`)."""
    path = as_path(path)
    rank, world = group_rank(group), group_size(group)
    problem, manifest = "", {}
    try:
        # The manifest lists files sorted by path, the same on every rank.
        manifest = verify(
            path, checksums=lambda index, entry: index % world == rank and (shards or not is_shard_file(entry["path"]))
        )
        if rank == 0:  # DCP's metadata: readable safely, naming only files the manifest lists, no pickled item
            read_metadata(path, manifest)
    except CheckpointCorruptError as err:
        problem = str(err)
    _raise_everywhere(problem, group)
    return manifest


def _raise_everywhere(problem: str, group: Any, *, alone: bool = False) -> None:
    """The first rank's problem (a ``CheckpointCorruptError`` message) raised on every rank."""
    if not alone:
        problem = next((p for p in gather_objects(problem, group) if p), "")
    if problem:
        raise CheckpointCorruptError(problem)


def _shard_entries(manifest: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {e["path"]: e for e in manifest["files"] if is_shard_file(e["path"])}


def _read(
    path: AnyPath, request: dict[str, Tensor], reader: ShardReader, group: Any, *, partial: bool, alone: bool = False
) -> None:
    """``dcp.load``; a rank's failure (DCP raises it on every rank) as a ``CheckpointCorruptError``
    naming the file when a file was found corrupted, else a ``RuntimeError`` naming each rank's error."""
    try:
        dcp.load(
            request,
            storage_reader=reader,
            planner=TensorsOnlyLoadPlanner(allow_partial_load=partial),
            process_group=group,
            no_dist=alone or not distributed(group),
        )
    except CheckpointException as err:
        failures = {r: (f[0] if isinstance(f, tuple) else f) for r, f in sorted(err.failures.items())}
        corrupt = next((e for e in failures.values() if isinstance(e, CheckpointCorruptError)), None)
        if corrupt is not None:
            raise CheckpointCorruptError(str(corrupt)) from None
        detail = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in failures.items())
        raise RuntimeError(f"Loading the checkpoint {path} failed. {detail}") from None


def check_unhashed(
    path: AnyPath, manifest: Mapping[str, Any], hashed: list[str], group: Any = None, *, alone: bool = False
) -> None:
    """After a load that hashed the shard files it read whole (``hashed``, this rank's; a mismatch
    raised already): hash the shard files no rank read whole, the work shared. A mismatch is raised
    on every rank, naming the file. ``alone``: this process loaded by itself (no collectives)."""
    path = as_path(path)
    done = set(hashed) if alone else {name for names in gather_objects(hashed, group) for name in names}
    rest = [e["path"] for e in manifest["files"] if is_shard_file(e["path"]) and e["path"] not in done]
    rank, world = (0, 1) if alone else (group_rank(group), group_size(group))
    mine = set(rest[rank::world])
    problem = ""
    try:
        verify(path, checksums=lambda _, entry: entry["path"] in mine)
    except CheckpointCorruptError as err:
        problem = str(err)
    _raise_everywhere(problem, group, alone=alone)


def _global_shape(tensor: Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)  # a DTensor's shape is the global one


def load_sharded(
    path: AnyPath,
    state: dict[str, Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    strict: bool = True,
    verified: bool | Literal["files"] = False,
) -> list[str]:
    """Load the checkpoint at ``path`` into ``state``'s tensors in place (DCP: each rank reads what its
    shards need, from any layout; dtypes are cast). Returns the keys of ``state`` the checkpoint lacks
    (``strict``: a ``KeyError`` naming them instead); a shape mismatch is a ``ValueError`` naming the
    key. Either is raised on every rank, before DCP's collectives.

    Verification (``verified=False``): the manifest, every file's size and the small files' checksums
    first; the shard files' checksums as they are read (each byte read once), then those no rank read
    whole. A corrupted shard is reported after its bytes were loaded: the ``CheckpointCorruptError``
    (on every rank, naming the file) means ``state`` holds garbage. ``verified="files"``: the caller
    checked the manifest and small files (:func:`verify_distributed` with ``shards=False``);
    ``True``: everything was checked."""
    path = as_path(path)
    manifest = verify_distributed(path, group=group, shards=False) if verified is False else read_manifest(path)
    hash_shards = verified is not True
    problem: tuple[str, str] | None = None
    try:
        metadata: Metadata | None = read_metadata(path, manifest)
    except CheckpointCorruptError as err:  # raised on every rank below, before any collective of DCP's
        metadata, problem = None, ("CheckpointCorruptError", str(err))
    saved = tensor_entries(metadata) if metadata is not None else {}
    missing = [k for k in state if k not in saved]
    if missing and strict and problem is None:
        problem = (
            "KeyError",
            (
                f"The checkpoint {path} has no {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)} entries "
                "missing). Load it into the model it was saved from, or non-strictly (LightningModule.strict_loading=False)."
            ),
        )
    for key, tensor in state.items():
        if problem is None and key in saved and tuple(saved[key].size) != _global_shape(tensor):
            problem = (
                "ValueError",
                (
                    f"{key!r} has shape {tuple(saved[key].size)} in the checkpoint {path} and {_global_shape(tensor)} "
                    "here: the checkpoint is of another model configuration."
                ),
            )
    problem = next((p for p in gather_objects(problem, group) if p is not None), None)
    if problem is not None:
        kinds = {"KeyError": KeyError, "ValueError": ValueError, "CheckpointCorruptError": CheckpointCorruptError}
        raise kinds[problem[0]](problem[1])
    request = {k: v for k, v in state.items() if k in saved}
    reader = ShardReader(path, expected=_shard_entries(manifest) if hash_shards else None, metadata=metadata)
    _read(path, request, reader, group, partial=True)
    if hash_shards:
        check_unhashed(path, manifest, reader.hashed, group)
    return missing


def full_tensors_from(
    path: AnyPath,
    keys: list[str] | None = None,
    *,
    manifest: Mapping[str, Any] | None = None,
    metadata: Metadata | None = None,
) -> dict[str, Tensor]:
    """Whole (unsharded) CPU tensors for ``keys`` (None: all) of a checkpoint, read in this process alone.
    ``manifest`` (its small files checked already): the shard files are hashed as they are read, and
    the rest after, as in :func:`load_sharded`. ``metadata``: DCP's, read once for many calls."""
    path = as_path(path)
    metadata = metadata if metadata is not None else SafeFileSystemReader(path, manifest=manifest).read_metadata()
    saved = tensor_entries(metadata)
    keys = list(saved) if keys is None else keys
    out = {k: torch.empty(tuple(saved[k].size), dtype=saved[k].properties.dtype) for k in keys}
    expected = _shard_entries(manifest) if manifest is not None else None
    reader = ShardReader(path, expected=expected, metadata=metadata)
    if out:
        _read(path, out, reader, None, partial=False, alone=True)
    if manifest is not None:
        check_unhashed(path, manifest, reader.hashed, alone=True)
    return out
