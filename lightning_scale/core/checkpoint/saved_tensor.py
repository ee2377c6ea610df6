"""Where a ``torch.save``'d tensor's bytes are, without ``torch.load``: what lets a checkpoint load
decode a tensor with no copy, or read it straight into its destination.

DCP stores each tensor chunk as a ``torch.save`` archive: an uncompressed zip whose ``data.pkl``
rebuilds the tensor from the storage record ``data/0``. The pickle may name only the rebuild
function, a storage class and ``OrderedDict``; anything else (several storages, big-endian data, a
layout not contiguous, a compressed record) is not the plain form, and the caller uses
``torch.load``. The layout is undocumented: :mod:`lightning_scale.core.compat` holds what is relied on
(``TORCH_SAVE_*``), and its canary checks it against torch.

- :func:`stored_tensor`: the tensor as a view of the archive's bytes.
- :func:`leading_tensor_range`: from the archive's first bytes only (its local headers and the
  pickle), the dtype, shape and byte range of the tensor, so the bytes after them can be read into
  the destination tensor directly, front to back; :func:`tensor_range` confirms it from the
  central directory, which comes after the tensor.

No Lightning, no process group.
"""

from __future__ import annotations

import io
import pickle
import sys
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from lightning_scale.core.compat import TORCH_SAVE_REBUILD_TENSOR, TORCH_SAVE_RECORDS, TORCH_SAVE_STORAGE_DTYPES

__all__ = ["TensorRange", "archive_directory", "leading_tensor_range", "stored_tensor", "tensor_range"]

_LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field


class _NotPlain(Exception):
    """The archive is not the one-storage form read here."""


class _Storage:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _rebuild(storage: Any, offset: int, size: Any, stride: Any, *_: Any) -> tuple[Any, int, tuple, tuple]:
    return storage, offset, tuple(size), tuple(stride)


class _TensorPickle(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == TORCH_SAVE_REBUILD_TENSOR:
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in TORCH_SAVE_STORAGE_DTYPES:
            return _Storage(TORCH_SAVE_STORAGE_DTYPES[name])
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid


class _View(io.RawIOBase):
    """A seekable reader handing out small copies of ``buffer``, which holds the archive's bytes from
    ``base`` to its end (``length``): what ``zipfile`` needs for the directory. Reading before
    ``base`` is :class:`_NotPlain`."""

    def __init__(self, buffer: memoryview, base: int = 0) -> None:
        self._buffer, self._base, self._pos = buffer, base, 0
        self._end = base + len(buffer)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else self._end + pos
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self._end if size is None or size < 0 else min(self._pos + size, self._end)
        if self._pos < self._base and end > self._pos:
            raise _NotPlain("the directory lies before the bytes read")
        out = bytes(self._buffer[self._pos - self._base : end - self._base])
        self._pos = max(end, self._pos)
        return out


@dataclass(frozen=True)
class TensorRange:
    """The tensor a plain archive holds: its bytes are ``[start, start + nbytes)`` of the archive."""

    dtype: torch.dtype
    size: tuple[int, ...]
    start: int
    nbytes: int


def archive_directory(tail: memoryview | bytes, length: int) -> dict[str, zipfile.ZipInfo] | None:
    """The records of a ``length``-byte archive by name, from its last ``len(tail)`` bytes (None: the
    directory is not all in them, or the archive is not the plain form)."""
    if sys.byteorder != "little":
        return None
    try:
        with zipfile.ZipFile(_View(memoryview(tail), length - len(tail))) as archive:
            names = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
    except (_NotPlain, zipfile.BadZipFile, ValueError, EOFError):
        return None
    if set(names) - TORCH_SAVE_RECORDS or "data.pkl" not in names or "data/0" not in names:
        return None
    if any(info.compress_type != zipfile.ZIP_STORED for info in names.values()):
        return None
    return names


def _record_start(head: memoryview, info: zipfile.ZipInfo) -> int:
    """Where a record's bytes begin: after its local header, whose extra field (torch pads it to
    align the storage) may differ from the central directory's."""
    at = info.header_offset
    local = bytes(head[at : at + _LOCAL_HEADER])
    if len(local) < _LOCAL_HEADER or local[:4] != b"PK\x03\x04":
        raise _NotPlain("no local header")
    return at + _LOCAL_HEADER + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")


def _plain_range(
    storage: Any, offset: int, size: tuple, stride: tuple, data_start: int, room: int
) -> TensorRange | None:
    """The byte range of a tensor rebuilt as ``_rebuild`` saw it, its storage record starting at
    ``data_start`` with ``room`` bytes (None: not one contiguous tensor of storage ``0`` inside them)."""
    if not (isinstance(storage, tuple) and len(storage) == 5 and storage[0] == "storage" and storage[2] == "0"):
        return None
    if not all(type(n) is int and n >= 0 for n in (offset, *size, *stride)):  # noqa: E721 - not bools, floats
        return None
    dtype = storage[1].dtype
    numel, contiguous, expected = 1, True, 1
    for n, s in zip(reversed(size), reversed(stride)):
        contiguous &= n == 1 or s == expected
        expected *= n
        numel *= n
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not contiguous or len(size) != len(stride) or offset < 0 or (offset + numel) * itemsize > room:
        return None
    return TensorRange(dtype, tuple(size), data_start + offset * itemsize, numel * itemsize)


def leading_tensor_range(head: memoryview | bytes, length: int) -> TensorRange | None:
    """The tensor of a ``length``-byte archive from its first bytes alone: ``data.pkl``'s local header
    and pickle (which ends itself), then the next local header of an uncompressed ``.../data/0``.
    A guess until :func:`tensor_range` confirms it from the central directory (None: not found)."""
    if sys.byteorder != "little":
        return None
    head = memoryview(head)
    try:
        if bytes(head[:4]) != b"PK\x03\x04" or not bytes(head[30 : 30 + _u16(head, 26)]).endswith(b"/data.pkl"):
            return None
        stream = io.BytesIO(bytes(head[_record_at(head, 0) :]))
        storage, offset, size, stride = _TensorPickle(stream).load()
        at, raw = _record_at(head, 0) + stream.tell(), bytes(head)
        while (at := raw.find(b"PK\x03\x04", at)) >= 0:
            name = bytes(head[at + 30 : at + 30 + _u16(head, at + 26)])
            if name.endswith(b"/data/0") and _u16(head, at + 8) == 0:
                return _plain_range(storage, offset, size, stride, _record_at(head, at), length - _record_at(head, at))
            at += 4
    except (
        _NotPlain,
        ValueError,
        TypeError,
        IndexError,
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        MemoryError,
    ):
        return None
    return None


def _u16(data: memoryview, at: int) -> int:
    if at + 2 > len(data):
        raise ValueError("past the bytes read")
    return int.from_bytes(data[at : at + 2], "little")


def _record_at(head: memoryview, at: int) -> int:
    """Where the record whose local header is at ``at`` begins."""
    if at + _LOCAL_HEADER > len(head):
        raise ValueError("past the bytes read")
    return at + _LOCAL_HEADER + _u16(head, at + 26) + _u16(head, at + 28)


def tensor_range(head: memoryview | bytes, directory: dict[str, zipfile.ZipInfo]) -> TensorRange | None:
    """The tensor's dtype, shape and byte range, from the archive's first ``len(head)`` bytes (which
    must hold ``data.pkl`` and the local header of ``data/0``) and its :func:`archive_directory`."""
    head = memoryview(head)
    try:
        if "byteorder" in directory:
            start = _record_start(head, directory["byteorder"])
            if bytes(head[start : start + directory["byteorder"].file_size]) != b"little":
                return None
        pkl = directory["data.pkl"]
        start = _record_start(head, pkl)
        if start + pkl.file_size > len(head):
            return None
        storage, offset, size, stride = _TensorPickle(io.BytesIO(bytes(head[start : start + pkl.file_size]))).load()
        record = directory["data/0"]
        data_start = _record_start(head, record)
    except (
        _NotPlain,
        ValueError,
        TypeError,
        IndexError,
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        MemoryError,
    ):
        return None
    return _plain_range(storage, offset, size, stride, data_start, record.file_size)


def stored_tensor(data: memoryview) -> torch.Tensor | None:
    """The tensor in a ``torch.save`` archive, viewing ``data`` (None: not the plain form; use torch.load)."""
    directory = archive_directory(data, len(data))
    found = tensor_range(data, directory) if directory is not None else None
    if found is None:
        return None
    if found.nbytes == 0:
        return torch.empty(found.size, dtype=found.dtype)
    count = found.nbytes // torch.empty((), dtype=found.dtype).element_size()
    return torch.frombuffer(data, dtype=found.dtype, count=count, offset=found.start).view(found.size)
