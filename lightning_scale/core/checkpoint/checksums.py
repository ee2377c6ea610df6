"""Checksums of checkpoint files: the algorithms a manifest may name (:data:`CHECKSUMS`), hashing a
stream of chunks on a worker thread (:class:`StreamHash`), a file's checksum, and the long-lived
thread pools checkpoint I/O runs on. No Lightning, no process group.

``"crc32"`` is zlib's CRC-32 (the default: it detects corruption at about 3 GB/s on one core, where
SHA-256 runs at 1.4); ``"sha256"`` also resists deliberate tampering, given a trusted manifest.
"""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lightning_scale.core.checkpoint.storage import AnyPath, RemotePath

__all__ = [
    "CHECKSUMS",
    "DEFAULT_CHECKSUM",
    "StreamHash",
    "check_checksum",
    "file_checksum",
    "new_digest",
    "thread_pool",
]

CHECKSUMS = ("crc32", "sha256")
DEFAULT_CHECKSUM = "crc32"
_CHUNK = 4 << 20

_POOLS: dict[str, ThreadPoolExecutor] = {}
os.register_at_fork(after_in_child=_POOLS.clear)  # a forked child has none of the parent's threads


def thread_pool(name: str) -> ThreadPoolExecutor:
    """Long-lived worker threads for checkpoint I/O and hashing, by use: threads made per save would
    each bring the allocator a new arena."""
    if name not in _POOLS:
        _POOLS[name] = ThreadPoolExecutor(4, thread_name_prefix=f"lightning-scale-{name}")
    return _POOLS[name]


def check_checksum(checksum: Any) -> str:
    """``checksum`` if it names one of :data:`CHECKSUMS`, else a ``ValueError`` listing them."""
    if checksum not in CHECKSUMS:
        raise ValueError(
            f"checksum={checksum!r} is not a checksum algorithm lightning-scale writes: choose one of {CHECKSUMS} "
            f"({DEFAULT_CHECKSUM!r}, the default, detects corruption; 'sha256' also resists tampering)."
        )
    return checksum


class _Crc32:
    """zlib's CRC-32 with hashlib's interface (zlib releases the GIL on large buffers)."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | memoryview) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def new_digest(checksum: str) -> Any:
    """A fresh hash object (``update``, ``hexdigest``) of the algorithm ``checksum`` names."""
    return _Crc32() if check_checksum(checksum) == "crc32" else hashlib.sha256()


class StreamHash:
    """The checksum of chunks given in order, hashed in that order on a worker thread while the
    caller goes on reading (zlib and hashlib release the GIL). :meth:`update` returns at once unless
    more than ``limit`` bytes of chunks the caller owns are waiting (memory stays bounded);
    ``borrowed`` chunks (views of memory that exists anyway, such as a destination tensor) do not
    count. ``done`` runs once the chunk is hashed (e.g. to reuse its buffer)."""

    def __init__(self, checksum: str = DEFAULT_CHECKSUM, *, limit: int = 64 << 20) -> None:
        self._digest = new_digest(checksum)
        self._queue: deque[tuple[Any, int, Callable[[], None] | None]] = deque()
        self._waiting = 0  # bytes of owned chunks queued
        self._limit = limit
        self._changed = threading.Condition()
        self._running: Any = None
        self._error: BaseException | None = None

    def update(
        self, data: bytes | memoryview, *, borrowed: bool = False, done: Callable[[], None] | None = None
    ) -> None:
        counted = 0 if borrowed else len(data)
        with self._changed:
            while self._error is None and self._waiting and self._waiting + counted > self._limit:
                self._changed.wait()
            if self._error is not None:
                raise self._error
            self._queue.append((data, counted, done))
            self._waiting += counted
            if self._running is None:
                self._running = thread_pool("hash").submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._changed:
                if not self._queue:
                    self._running = None
                    return
                data, counted, done = self._queue.popleft()
            try:
                self._digest.update(data)
                if done is not None:
                    done()
            except BaseException as err:  # noqa: BLE001 - raised by the next update() or hexdigest()
                with self._changed:
                    self._error, self._running = err, None
                    self._queue.clear()
                    self._waiting = 0
                    self._changed.notify_all()
                return
            with self._changed:
                self._waiting -= counted
                self._changed.notify_all()

    def cancel(self) -> None:
        """Drop the chunks not hashed yet (the caller gave up on this stream)."""
        with self._changed:
            self._queue.clear()
            self._waiting = 0
            self._changed.notify_all()

    def hexdigest(self) -> str:
        while True:
            with self._changed:
                running, error = self._running, self._error
            if error is not None:
                raise error
            if running is None:
                return self._digest.hexdigest()
            running.result()


def file_checksum(path: AnyPath, checksum: str = DEFAULT_CHECKSUM) -> str:
    """The file's checksum, reading the next chunk while the last one is hashed."""
    digest = StreamHash(checksum, limit=2 * _CHUNK)
    with path.open("rb") if isinstance(path, RemotePath) else open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
