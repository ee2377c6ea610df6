"""Where checkpoints live: a local directory, or any fsspec URL (``s3://bucket/run``, ``gs://...``,
``memory://...``, ``file:///...``) once the filesystem's package (``s3fs``, ``gcsfs``, ...) is
installed. No Lightning, no process group.

:func:`as_path` turns a path or URL into a :class:`pathlib.Path` (local) or a :class:`RemotePath`,
which has the part of ``Path``'s interface the checkpoint code uses, over an fsspec filesystem
(fsspec comes with torch; URLs are resolved through DCP's fsspec layer). The few operations
``Path`` lacks are functions here that take either kind: :func:`replace`, :func:`rmtree`,
:func:`write_durable`.

Object stores cannot rename a directory atomically (fsspec moves it file by file, copying each);
:func:`renames_atomically` says whether a path's filesystem can. The checkpoint format uses it to
write such checkpoints in place, with the manifest (one object, written last) as the commit.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
import shutil
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from types import SimpleNamespace
from typing import IO, Any

from lightning_scale.core.compat import dcp_fsspec_filesystem, strip_protocol

__all__ = ["AnyPath", "RemotePath", "as_path", "is_url", "renames_atomically", "replace", "rmtree", "write_durable"]


def is_url(path: Any) -> bool:
    """True for ``RemotePath`` and for strings with a protocol (``s3://...``)."""
    return isinstance(path, RemotePath) or (isinstance(path, str) and "://" in path)


class RemotePath:
    """A path on an fsspec filesystem with the subset of :class:`pathlib.Path` checkpoints use.
    ``str()`` is the URL, which :func:`as_path` reads back."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.path = path.rstrip("/") or "/"

    @property
    def url(self) -> str:
        return self.fs.unstrip_protocol(self.path)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and (self.fs.protocol, self.path) == (other.fs.protocol, other.path)

    def __hash__(self) -> int:
        return hash((str(self.fs.protocol), self.path))

    def __lt__(self, other: RemotePath) -> bool:
        return self.path < other.path

    def __truediv__(self, name: str | PurePosixPath) -> RemotePath:
        return RemotePath(self.fs, posixpath.join(self.path, str(name)))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.fs, posixpath.dirname(self.path))

    def exists(self) -> bool:
        return bool(self.fs.exists(self.path))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.path))

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.path))

    def is_symlink(self) -> bool:
        return False

    def resolve(self) -> RemotePath:
        return self

    def iterdir(self) -> list[RemotePath]:
        return [self / posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.path, detail=False)]

    def glob(self, pattern: str) -> list[RemotePath]:
        """The children whose name matches ``pattern`` (one level, as ``Path.glob`` without ``/``)."""
        return [p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern)]

    def relative_to(self, other: RemotePath) -> PurePosixPath:
        relative = posixpath.relpath(self.path, other.path)
        if relative.startswith(".."):
            raise ValueError(f"{self} is not under {other}.")
        return PurePosixPath(relative)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        self.fs.makedirs(self.path, exist_ok=True)

    def stat(self) -> SimpleNamespace:
        return SimpleNamespace(st_size=int(self.fs.size(self.path)))

    def open(self, mode: str = "r", **kwargs: Any) -> IO[Any]:
        return self.fs.open(self.path, mode, **kwargs)

    def read_bytes(self) -> bytes:
        return bytes(self.fs.cat_file(self.path))

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def unlink(self) -> None:
        self.fs.rm_file(self.path)


AnyPath = Path | RemotePath


def as_path(path: Any, storage_options: Mapping[str, Any] | None = None) -> AnyPath:
    """A ``Path`` for a local path, a :class:`RemotePath` for a URL (``storage_options`` go to
    fsspec's ``url_to_fs``: credentials, endpoint, ...). An unknown protocol, or one whose package is
    not installed, is a ``ValueError`` saying which package to install."""
    if isinstance(path, (Path, RemotePath)):
        return path
    if isinstance(path, os.PathLike):
        return Path(path)
    if not isinstance(path, str):
        raise TypeError(f"A checkpoint path must be a str or os.PathLike, got {type(path).__name__}: {path!r}.")
    if "://" not in path:
        return Path(path)
    # DCP's own fsspec layer resolves the URL (fsspec comes with torch; core imports torch only).
    layer = dcp_fsspec_filesystem()
    try:
        layer.init_path(path, **dict(storage_options or {}))
        fs = layer.fs
        inner = strip_protocol(fs, path)
    except (ImportError, ValueError) as err:
        raise ValueError(
            f"Cannot open the checkpoint location {path!r}: {err}. Install the fsspec filesystem for its protocol "
            "(pip install 'lightning-scale[s3]' for s3://, 'lightning-scale[gcs]' for gs://, adlfs for az://) or "
            "use a local path."
        ) from None
    return RemotePath(fs, inner)


def renames_atomically(path: AnyPath) -> bool:
    """Whether a directory at ``path`` can be renamed in one atomic step (local filesystems)."""
    return not isinstance(path, RemotePath) or "file" in _protocols(path.fs)


def _protocols(fs: Any) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def replace(src: AnyPath, dst: AnyPath) -> None:
    """Rename ``src`` to ``dst`` (``os.replace``; on fsspec, a move, which object stores do by copying)."""
    if isinstance(src, RemotePath):
        src.fs.mv(src.path, _same_fs(src, dst).path, recursive=True)
    else:
        os.replace(src, dst)


def rmtree(path: AnyPath) -> None:
    """Delete a directory and everything in it, ignoring errors (as ``shutil.rmtree(ignore_errors=True)``)."""
    if isinstance(path, RemotePath):
        try:
            if path.fs.exists(path.path):
                path.fs.rm(path.path, recursive=True)
        except (OSError, FileNotFoundError):
            pass
    else:
        shutil.rmtree(path, ignore_errors=True)


def write_durable(path: AnyPath, data: bytes) -> None:
    """Write ``data`` as the file ``path`` and make it durable (fsync locally; an object store's write
    is durable once it returns)."""
    if isinstance(path, RemotePath):
        path.fs.pipe_file(path.path, data)
        return
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _same_fs(src: RemotePath, dst: Any) -> RemotePath:
    if not isinstance(dst, RemotePath) or _protocols(dst.fs) != _protocols(src.fs):
        raise ValueError(f"Cannot move {src} to {dst}: they are on different filesystems.")
    return dst
