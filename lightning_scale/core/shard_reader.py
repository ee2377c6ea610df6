"""Reading DCP checkpoints: safely (no code a checkpoint chose runs), quickly, and verified as read.

- :class:`SafeFileSystemReader`: DCP's reader (its fsspec one for a URL) whose ``.metadata`` is read
  by an unpickler that knows only DCP's metadata classes; :class:`TensorsOnlyLoadPlanner` refuses
  pickled items, so a load unpickles nothing arbitrary.
- :class:`ShardReader`: DCP's ``read_data`` (one ``torch.load`` per item from a file view, each
  file read once for the items and once more to verify it) redone: each file's items are read in
  offset order with large reads, the next read running while this item is decoded, and every
  file the rank needs at least half of is read whole and its SHA-256 computed as it streams past,
  so a verified load reads each byte once.

No Lightning, no process group.
"""

from __future__ import annotations

import io
import pickle
import sys
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem as LocalFileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from lightning_scale.core.checkpoint_format import MANIFEST, CheckpointCorruptError, StreamHash, thread_pool
from lightning_scale.core.storage import AnyPath, RemotePath, as_path

__all__ = ["SafeFileSystemReader", "ShardReader", "TensorsOnlyLoadPlanner", "dcp_filesystem", "dcp_id"]

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


def dcp_filesystem(path: AnyPath) -> Any:
    """DCP's filesystem layer for ``path``: its local one, or its fsspec one for a URL."""
    if isinstance(path, RemotePath):
        from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem

        return FsspecFileSystem()
    return LocalFileSystem()


def dcp_id(path: AnyPath) -> Any:
    return str(path) if isinstance(path, RemotePath) else path


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` (its fsspec reader for a URL) whose metadata is read by
    :class:`_MetadataUnpickler` (``metadata``: read already, e.g. for many loads from one checkpoint)."""

    def __init__(self, path: Any, metadata: Metadata | None = None) -> None:
        path = as_path(path)
        super().__init__(".")
        self.fs = dcp_filesystem(path)
        self.path = self.fs.init_path(dcp_id(path))
        self._metadata = metadata

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.fs = dcp_filesystem(as_path(checkpoint_id))
            checkpoint_id = dcp_id(as_path(checkpoint_id))
            if checkpoint_id != self.path:
                self._metadata = None
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        if self._metadata is not None and rank is None:
            metadata = self._metadata
        else:
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


class ShardReader(SafeFileSystemReader):
    """:class:`SafeFileSystemReader` with a faster ``read_data`` that can verify what it reads.

    ``expected``: manifest entries by file name. Of those, each file this rank needs at least half
    of is read whole, front to back, and hashed on the way; a mismatch is a
    ``CheckpointCorruptError`` naming the file (raised once the file is read, also when decoding it
    failed first). :attr:`hashed` lists the files checked, for the caller to hash the rest.
    Files written with DCP stream extensions take DCP's own path.
    """

    def __init__(
        self, path: Any, expected: Mapping[str, Mapping[str, Any]] | None = None, metadata: Metadata | None = None
    ) -> None:
        super().__init__(path, metadata)
        self.expected = dict(expected or {})
        self.hashed: list[str] = []

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if any(self.storage_data[item.storage_index].transform_descriptors for item in plan.items):
            return super().read_data(plan, planner)
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        # Files side by side (DCP writes ``thread_count`` files per rank): their reads and hashes overlap.
        results = [thread_pool("load").submit(self._read_file, name, items, planner) for name, items in per_file.items()]
        errors = [e for e in (r.exception() for r in results) if e is not None]  # every file done first
        if errors:
            raise next((e for e in errors if isinstance(e, CheckpointCorruptError)), errors[0])
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, relative: str, items: list[Any], planner: LoadPlanner) -> None:
        by_range: dict[tuple[int, int], list[Any]] = {}
        for item in items:
            info = self.storage_data[item.storage_index]
            by_range.setdefault((info.offset, info.length), []).append(item)
        entry = self.expected.get(relative)
        needed = sum(length for _, length in by_range)
        digest = StreamHash() if entry is not None and 2 * needed >= int(entry["bytes"]) else None
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
        # Buffers are reused (one being read, one decoded, one hashed): fresh memory for every item
        # would cost a page fault per 4 KB, which on some VMs takes longer than the disk.
        spare: list[bytearray] = []
        lock = threading.Lock()
        hashing: bytearray | None = None

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

        with self.fs.create_stream(path, "rb") as stream:

            def read(offset: int, length: int) -> tuple[bytearray, memoryview]:
                if stream.tell() != offset:
                    stream.seek(offset)
                buffer, done = take(length), 0
                view = memoryview(buffer)[:length]
                while done < length:
                    n = stream.readinto(view[done:])
                    if not n:
                        raise CheckpointCorruptError(f"{path} ends at byte {offset + done}, inside an item: truncated.")
                    done += n
                return buffer, view

            pending = thread_pool("read").submit(read, *segments[0][:2]) if segments else None
            try:
                for i, (_, _, held) in enumerate(segments):
                    assert pending is not None
                    buffer, data = pending.result()
                    pending = thread_pool("read").submit(read, *segments[i + 1][:2]) if i + 1 < len(segments) else None
                    if digest is not None:
                        digest.update(data)  # returns once the previous buffer is hashed
                        give(hashing)
                        hashing = buffer
                    if held and failure is None:
                        try:
                            _decode(data, held, planner)
                        except Exception as err:  # noqa: BLE001 - a corrupted file explains it, if it is one
                            if digest is None:
                                raise
                            failure = err
                    if digest is None:
                        give(buffer)
            finally:
                if pending is not None:
                    pending.exception()  # no read may outlive the stream
        if digest is not None:
            self.hashed.append(relative)
            if digest.hexdigest() != entry.get("sha256"):
                raise CheckpointCorruptError(
                    f"{path} does not match its SHA-256 in {self.fs.concat_path(self.path, MANIFEST)}: corrupted."
                ) from failure
        if failure is not None:
            raise failure


def _decode(data: memoryview, items: list[Any], planner: LoadPlanner) -> None:
    """Every read item held by one stored item's bytes, into its destination tensor."""
    if items[0].type == LoadItemType.BYTE_IO:
        for item in items:
            planner.load_bytes(item, io.BytesIO(data))
        return
    stored = _stored_tensor(data)
    if stored is None:
        stored = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    for item in items:
        tensor = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointCorruptError(
                f"{item.storage_index.fqn}: the checkpoint's piece is {tuple(tensor.size())}, the destination "
                f"{tuple(target.size())}."
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)


# ---------------------------------------------------------------------- one torch.save'd tensor, without a copy
#
# DCP stores each tensor chunk as a ``torch.save`` archive: an uncompressed zip whose ``data.pkl``
# rebuilds the tensor from the storage record ``data/0``. ``torch.load`` from bytes copies the
# storage out; :func:`_stored_tensor` instead reads the zip directory and the pickle (which may
# name only the rebuild function, a storage class and OrderedDict) and returns a view of the
# bytes. Anything else (several storages, big-endian data, a layout not contiguous) is left to
# ``torch.load``.

_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


class _NotPlain(Exception):
    """The archive is not the one-storage form :func:`_stored_tensor` reads."""


class _Storage:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _rebuild(storage: Any, offset: int, size: Any, stride: Any, *_: Any) -> tuple[Any, int, tuple, tuple]:
    return storage, offset, tuple(size), tuple(stride)


class _TensorPickle(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _Storage(_STORAGE_DTYPES[name])
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid


class _View(io.RawIOBase):
    """A seekable reader over a buffer handing out small copies: what ``zipfile`` needs for the directory."""

    def __init__(self, buffer: memoryview) -> None:
        self._buffer, self._pos = buffer, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else len(self._buffer) + pos
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._buffer) if size is None or size < 0 else min(self._pos + size, len(self._buffer))
        out = bytes(self._buffer[self._pos : end])
        self._pos = max(end, self._pos)
        return out


def _stored_tensor(data: memoryview) -> torch.Tensor | None:
    """The tensor in a ``torch.save`` archive, viewing ``data`` (None: not the plain form; use torch.load)."""
    if sys.byteorder != "little":
        return None
    try:
        with zipfile.ZipFile(_View(memoryview(data))) as archive:
            names = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
            if set(names) - {"data.pkl", "data/0", "byteorder", "version", ".format_version",
                             ".storage_alignment", ".data/serialization_id"}:  # fmt: skip
                return None
            if "byteorder" in names and archive.read(names["byteorder"]) != b"little":
                return None
            storage, offset, size, stride = _TensorPickle(io.BytesIO(archive.read(names["data.pkl"]))).load()
            record = names["data/0"]
            if record.compress_type != zipfile.ZIP_STORED:
                return None
            local = bytes(data[record.header_offset : record.header_offset + 30])
            name_and_extra = int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
            start = record.header_offset + 30 + name_and_extra
    except (_NotPlain, zipfile.BadZipFile, KeyError, ValueError, TypeError, pickle.UnpicklingError, EOFError):
        return None
    if not (isinstance(storage, tuple) and len(storage) == 5 and storage[0] == "storage" and storage[2] == "0"):
        return None
    dtype = storage[1].dtype
    numel = 1
    for n in size:
        numel *= n
    contiguous, expected = True, 1
    for n, s in zip(reversed(size), reversed(stride)):
        contiguous &= n == 1 or s == expected
        expected *= n
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not contiguous or (offset + numel) * itemsize > record.file_size or local[:4] != b"PK\x03\x04":
        return None
    if numel == 0:
        return torch.empty(size, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=numel, offset=start + offset * itemsize).view(size)
