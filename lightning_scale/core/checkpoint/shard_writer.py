"""Writing DCP checkpoints: :class:`StagingWriter`, DCP's ``FileSystemWriter`` (its fsspec layer for
a URL) with reused host buffers for async saves (:mod:`.host_staging`), hashing each shard file as it
is written so the manifest needs no second read. No Lightning, no process group.
"""

from __future__ import annotations

import io
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from lightning_scale.core.checkpoint.checksums import DEFAULT_CHECKSUM, check_checksum, new_digest
from lightning_scale.core.checkpoint.format import is_shard_file
from lightning_scale.core.checkpoint.host_staging import HostStager
from lightning_scale.core.checkpoint.shard_reader import dcp_filesystem, dcp_id
from lightning_scale.core.checkpoint.storage import RemotePath, as_path

__all__ = ["StagingWriter"]


class _HashingStream(io.RawIOBase):
    """A write stream that hashes what passes through it, in order (DCP writes each file front to
    back from one thread; a seek makes the digest unusable, and the file is hashed again after)."""

    def __init__(self, inner: Any, checksum: str) -> None:
        self._inner, self._digest, self.size, self.sequential = inner, new_digest(checksum), 0, True

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        # Synchronous: torch.save hands memoryviews of buffers that live only for this call. zlib and
        # hashlib release the GIL, so the files of several writer threads hash side by side.
        view = memoryview(data).cast("B")
        self._digest.update(view)
        written = self._inner.write(view)
        self.size += len(view)
        return len(view) if written is None else written

    def tell(self) -> int:
        return self._inner.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        self.sequential = False
        return self._inner.seek(offset, whence)

    def fileno(self) -> int:
        return self._inner.fileno()

    def flush(self) -> None:
        if not self._inner.closed:
            self._inner.flush()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes
            self._inner.close()

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


class _HashingFileSystem:
    """DCP's filesystem layer, hashing the shard files it writes: :attr:`digests` maps each file name
    to its (size, ``checksum`` digest), so the manifest needs no second read of what was written."""

    def __init__(self, inner: Any, checksum: str) -> None:
        self._inner, self.checksum = inner, checksum
        self.digests: dict[str, tuple[int, str]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Any:
        name = str(path).rsplit("/", 1)[-1]
        with self._inner.create_stream(path, mode) as stream:
            if "w" not in mode or not is_shard_file(name):
                yield stream
                return
            hashing = _HashingStream(stream, self.checksum)
            yield hashing
        if hashing.sequential:
            self.digests[name] = (hashing.size, hashing.hexdigest())


class StagingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` whose :meth:`stage` copies a state dict into host buffers kept from the
    previous save (a :class:`~lightning_scale.core.checkpoint.host_staging.HostStager`: pinned, and filled
    by non-blocking copies on a side stream, where CUDA is available), rebuilt for the tensors whose shape
    or dtype changed; the thread that writes calls :meth:`synchronize_staging` first. ``cache=False``: new
    buffers on every save. Each save's path picks DCP's local or fsspec filesystem (``fsync`` locally; an
    object store's write is durable when it returns); the shard files are hashed as they are written
    (:attr:`digests`, with the algorithm ``checksum`` names: one of ``CHECKSUMS``)."""

    def __init__(self, *, thread_count: int = 1, cache: bool = True, checksum: str = DEFAULT_CHECKSUM) -> None:
        # DCP's own staging (cache_staged_state_dict) is replaced by the HostStager below.
        super().__init__(".", sync_files=True, thread_count=thread_count, cache_staged_state_dict=False)
        self.checksum = check_checksum(checksum)
        self.stager = HostStager(reuse=cache)
        self.digests: dict[str, tuple[int, str]] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            path = as_path(checkpoint_id)
            self.fs = _HashingFileSystem(dcp_filesystem(path), self.checksum)
            self.digests = self.fs.digests
            self.sync_files = not isinstance(path, RemotePath)
            checkpoint_id = dcp_id(path)
        super().reset(checkpoint_id)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict``'s tensors in this writer's host buffers (see :class:`HostStager`)."""
        return self.stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        """Wait until the last :meth:`stage`'s copies are in the host buffers (the writing thread, before it writes)."""
        self.stager.synchronize()
