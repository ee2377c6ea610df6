"""Reading DCP checkpoints: safely (no code a checkpoint chose runs), quickly, and verified as read.

- :class:`SafeFileSystemReader`: DCP's reader (its fsspec one for a URL) whose ``.metadata`` is read
  only once the manifest vouches for it, by an unpickler that resolves only DCP's own classes, and
  checked before DCP uses it (:mod:`lightning_scale.core.checkpoint.dcp_metadata`: every file it points to
  listed in the manifest, no pickled item); :class:`TensorsOnlyLoadPlanner` refuses pickled items
  too, so a load unpickles nothing a checkpoint chose and opens no file its manifest does not list.
- :class:`ShardReader`: DCP's ``read_data`` (one ``torch.load`` per item from a file view, each
  file read once for the items and once more to verify it) redone: each file's items are read in
  offset order with large reads, the next read running while this item is decoded, and every
  file the rank needs at least half of is read whole and its checksum computed as it streams past
  (on a worker thread, in file order), so a verified load reads each byte once. A large tensor
  whose destination takes it as stored is read from the file straight into the destination and
  hashed there: no buffer, no copy.

No Lightning, no process group.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem as LocalFileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from lightning_scale.core.checkpoint.checksums import StreamHash, thread_pool
from lightning_scale.core.checkpoint.dcp_metadata import read_metadata
from lightning_scale.core.checkpoint.format import MANIFEST, CheckpointCorruptError, entry_checksum, read_manifest
from lightning_scale.core.checkpoint.saved_tensor import (
    archive_directory,
    leading_tensor_range,
    stored_tensor,
    tensor_range,
)
from lightning_scale.core.checkpoint.storage import AnyPath, RemotePath, as_path
from lightning_scale.core.compat import dcp_fsspec_filesystem, dcp_metadata_file

__all__ = ["SafeFileSystemReader", "ShardReader", "TensorsOnlyLoadPlanner", "dcp_filesystem", "dcp_id"]


def dcp_filesystem(path: AnyPath) -> Any:
    """DCP's filesystem layer for ``path``: its local one, or its fsspec one for a URL."""
    if isinstance(path, RemotePath):
        return dcp_fsspec_filesystem()
    return LocalFileSystem()


def dcp_id(path: AnyPath) -> Any:
    return str(path) if isinstance(path, RemotePath) else path


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` (its fsspec reader for a URL) whose metadata is read by
    :func:`~lightning_scale.core.checkpoint.dcp_metadata.read_metadata`: only once the manifest vouches for it,
    by an unpickler that resolves nothing but DCP's own classes, and checked (every file it points
    to listed in the manifest, no pickled item) before DCP sees it. ``metadata``: read that way
    already (e.g. for many loads from one checkpoint); ``manifest``: the checkpoint's, read already."""

    def __init__(self, path: Any, metadata: Metadata | None = None, manifest: Mapping[str, Any] | None = None) -> None:
        path = as_path(path)
        super().__init__(".")
        self.fs = dcp_filesystem(path)
        self.path = self.fs.init_path(dcp_id(path))
        self._checkpoint, self._metadata, self._manifest = path, metadata, manifest

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            checkpoint = as_path(checkpoint_id)
            self.fs = dcp_filesystem(checkpoint)
            checkpoint_id = dcp_id(checkpoint)
            if checkpoint_id != self.path:
                self._checkpoint, self._metadata, self._manifest = checkpoint, None, None
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if self._metadata is not None and rank is None:
            metadata = self._metadata
        else:
            if self._manifest is None:
                self._manifest = read_manifest(self._checkpoint)
            name = dcp_metadata_file(rank)  # rank: a no-collectives load
            metadata = read_metadata(self._checkpoint, self._manifest, name=name)
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


class ShardReader(SafeFileSystemReader):
    """:class:`SafeFileSystemReader` with a faster ``read_data`` that can verify what it reads.

    ``expected``: manifest entries by file name. Of those, each file this rank needs at least half
    of is read whole, front to back, and hashed on the way; a mismatch is a
    ``CheckpointCorruptError`` naming the file (raised once the file is read, also when decoding it
    failed first). :attr:`hashed` lists the files checked, for the caller to hash the rest.
    Files written with DCP stream extensions take DCP's own path.
    """

    def __init__(
        self,
        path: Any,
        expected: Mapping[str, Mapping[str, Any]] | None = None,
        metadata: Metadata | None = None,
        manifest: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(path, metadata, manifest)
        self.expected = dict(expected or {})
        self.hashed: list[str] = []

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if any(self.storage_data[item.storage_index].transform_descriptors for item in plan.items):
            return super().read_data(plan, planner)
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        shared = _overlapping(plan.items, planner)
        # Files side by side (DCP writes ``thread_count`` files per rank): their reads and hashes overlap.
        results = [
            thread_pool("load").submit(self._read_file, name, items, planner, shared)
            for name, items in per_file.items()
        ]
        errors = [e for e in (r.exception() for r in results) if e is not None]  # every file done first
        if errors:
            raise next((e for e in errors if isinstance(e, CheckpointCorruptError)), errors[0])
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, relative: str, items: list[Any], planner: LoadPlanner, shared: set[int]) -> None:
        by_range: dict[tuple[int, int], list[Any]] = {}
        for item in items:
            info = self.storage_data[item.storage_index]
            by_range.setdefault((info.offset, info.length), []).append(item)
        entry = self.expected.get(relative)
        needed = sum(length for _, length in by_range)
        manifest = self.fs.concat_path(self.path, MANIFEST)
        algorithm, expected = entry_checksum(entry, manifest) if entry is not None else ("", "")
        digest = StreamHash(algorithm) if entry is not None and 2 * needed >= int(entry["bytes"]) else None
        # (offset, length, the items it holds): with a digest, the gaps between items too, to the end.
        segments: list[tuple[int, int, list[Any]]] = []
        position = 0
        for offset, length in sorted(by_range):
            if digest is not None and offset > position:
                segments.append((position, offset - position, []))
            segments.append((offset, length, by_range[(offset, length)]))
            position = offset + length
        if digest is not None and position < int(entry["bytes"]):
            segments.append((position, int(entry["bytes"]) - position, []))
        path = self.fs.concat_path(self.path, relative)
        failure: BaseException | None = None
        # Buffers are reused once decoded and hashed: fresh memory for every item would cost a page
        # fault per 4 KB, which on some VMs takes longer than the disk.
        spare: list[bytearray] = []
        lock = threading.Lock()

        def take(length: int) -> bytearray:
            with lock:
                fits = [b for b in spare if len(b) >= length]
                if fits:
                    spare.remove(fits[0])
                    return fits[0]
                if spare:
                    spare.pop(0)
            return bytearray(length)

        def give(buffer: bytearray | None) -> None:
            if buffer is not None:
                with lock:
                    spare.append(buffer)

        def after_both(buffer: bytearray) -> Any:
            """Gives ``buffer`` back at the second call: once decoded and once hashed."""
            left = [2]

            def release() -> None:
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        spare.append(buffer)

            return release

        # Large tensors a local file holds whole and the destination takes as they are: read
        # straight into the destination, no buffer, no copy (their bytes are then hashed there).
        local = isinstance(self.fs, LocalFileSystem)
        targets = [_direct_target(held, planner, length, shared) if local else None for _, length, held in segments]

        with self.fs.create_stream(path, "rb") as stream:

            def read_into(offset: int, view: memoryview) -> memoryview:
                if stream.tell() != offset:
                    stream.seek(offset)
                done = 0
                while done < len(view):
                    n = stream.readinto(view[done:])
                    if not n:
                        raise CheckpointCorruptError(f"{path} ends at byte {offset + done}, inside an item: truncated.")
                    done += n
                return view

            def read(i: int) -> tuple[bytearray | None, memoryview | None, list[tuple[memoryview, bool]]]:
                """Segment ``i``: (buffer, its bytes, what to hash in file order, each with whether it
                is a view of the destination); (None, None, what to hash) when it went straight into
                its destination."""
                offset, length, _ = segments[i]
                if targets[i] is not None:
                    try:
                        pieces = _read_direct(lambda at, view: read_into(offset + at, view), length, targets[i])
                    except CheckpointCorruptError:
                        raise
                    except Exception:  # noqa: BLE001 - bytes that do not parse: the buffered path decides
                        pieces = None
                    if pieces is not None:
                        return None, None, pieces
                buffer = take(length)
                view = read_into(offset, memoryview(buffer)[:length])
                return buffer, view, [(view, False)]

            pending = thread_pool("read").submit(read, 0) if segments else None
            try:
                for i, (_, _, held) in enumerate(segments):
                    assert pending is not None
                    buffer, data, pieces = pending.result()
                    pending = thread_pool("read").submit(read, i + 1) if i + 1 < len(segments) else None
                    release = after_both(buffer) if buffer is not None and digest is not None else None
                    if digest is not None:  # hashed on a worker thread, in file order, while we go on
                        for piece, borrowed in pieces:
                            digest.update(piece, borrowed=borrowed, done=release if piece is data else None)
                    if held and failure is None:
                        try:
                            if data is None:
                                planner.commit_tensor(held[0], targets[i])
                            else:
                                _decode(data, held, planner)
                        except Exception as err:  # noqa: BLE001 - a corrupted file explains it, if it is one
                            if digest is None:
                                raise
                            failure = err
                    if release is not None:
                        release()
                    else:
                        give(buffer)
            except BaseException:
                if digest is not None:
                    digest.cancel()  # nothing left to check: stop hashing
                raise
            finally:
                if pending is not None:
                    pending.exception()  # no read may outlive the stream
        if digest is not None:
            self.hashed.append(relative)
            if digest.hexdigest() != expected:
                raise CheckpointCorruptError(
                    f"{path} does not match its {algorithm} in {manifest}: corrupted."
                ) from failure
        if failure is not None:
            raise failure


def _decode(data: memoryview, items: list[Any], planner: LoadPlanner) -> None:
    """Every read item held by one stored item's bytes, into its destination tensor."""
    if items[0].type == LoadItemType.BYTE_IO:
        for item in items:
            planner.load_bytes(item, io.BytesIO(data))
        return
    stored = stored_tensor(data)
    if stored is None:
        stored = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    for item in items:
        tensor = _narrow(stored, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointCorruptError(
                f"{item.storage_index.fqn}: the checkpoint's piece is {tuple(tensor.size())}, the destination "
                f"{tuple(target.size())}."
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def _narrow(tensor: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    """The piece of ``tensor`` at ``offsets`` of ``sizes`` (a view): what DCP's private
    ``narrow_tensor_by_index`` does, with the public ``Tensor.narrow``."""
    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
        if size < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, size)
    return tensor


_DIRECT_MIN = 1 << 20  # smaller items go through a buffer: a seek or two would cost more than the copy
_HEAD = 4096  # an archive's first bytes, read first: its local headers, the pickle, the tensor's first bytes


def _overlapping(items: list[Any], planner: LoadPlanner) -> set[int]:
    """``id``s of the tensor items whose destination memory overlaps another item's (tied weights, one
    tensor under two names): never read into directly, where one copy's bytes could be hashed after
    the other copy overwrote them."""
    spans = []
    for item in items:
        if item.type != LoadItemType.TENSOR:
            continue
        target = planner.resolve_tensor(item).detach()
        if target.device.type != "cpu" or target.numel() == 0:
            continue
        extent = 1 + sum((n - 1) * abs(s) for n, s in zip(target.shape, target.stride()))
        start = target.data_ptr()
        spans.append((start, start + extent * target.element_size(), id(item)))
    spans.sort()
    shared: set[int] = set()
    reach, owner = -1, -1
    for start, end, key in spans:
        if start < reach:
            shared.update((key, owner))
        if end > reach:
            reach, owner = end, key
    return shared


def _direct_target(held: list[Any], planner: LoadPlanner, length: int, shared: set[int]) -> torch.Tensor | None:
    """The destination a stored item can be read into as it is: one whole tensor piece, the
    destination a contiguous CPU tensor of its shape (dtype checked once the archive is parsed) that
    no other item's destination overlaps (:func:`_overlapping`)."""
    if length < _DIRECT_MIN or len(held) != 1 or held[0].type != LoadItemType.TENSOR or id(held[0]) in shared:
        return None
    item = held[0]
    if any(int(o) != 0 for o in item.storage_offsets):
        return None
    target = planner.resolve_tensor(item).detach()
    if target.device.type != "cpu" or not target.is_contiguous() or tuple(target.shape) != tuple(item.lengths):
        return None
    return target if target.numel() else None


def _read_direct(read_into: Any, length: int, target: torch.Tensor) -> list[tuple[memoryview, bool]] | None:
    """Read a ``length``-byte archive front to back (``read_into(offset, view)`` fills ``view`` from
    there, or raises a truncation error), its tensor's bytes straight into ``target``. Returns the
    archive's bytes in order, to hash, each with whether it is a view of ``target``. None: not a tensor ``target`` takes as it is, or the central
    directory (read last) disagrees with the local headers; the caller reads the archive again
    through a buffer, which overwrites whatever went into ``target``."""

    def read(at: int, n: int) -> memoryview:
        return read_into(at, memoryview(bytearray(n)))

    head_end = min(_HEAD, length)
    head = read(0, head_end)
    found = leading_tensor_range(head, length)
    if found is None or found.dtype != target.dtype or found.size != tuple(target.shape):
        return None
    start, end = found.start, found.start + found.nbytes
    if start > head_end or found.nbytes != target.numel() * target.element_size():
        return None
    into = memoryview(target.view(-1).view(torch.uint8).numpy()).cast("B")
    pieces = [(head, False)]
    if start < head_end:  # the head ran into the tensor's first bytes
        into[: min(end, head_end) - start] = head[start : min(end, head_end)]
    if end > head_end:
        pieces.append((read_into(head_end, into[head_end - start :]), True))
    tail_start = max(end, head_end)
    tail = read(tail_start, length - tail_start)  # the small records after the tensor, the directory
    if len(tail):
        pieces.append((tail, False))
    whole = memoryview(bytes(head) + bytes(tail)) if tail_start == head_end else None  # a small archive
    directory = archive_directory(whole if whole is not None else tail, length)
    if directory is None or tensor_range(whole if whole is not None else head, directory) != found:
        return None
    return pieces
