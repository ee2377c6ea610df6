"""Writing a checkpoint directory (``../shared/DESIGN.md``) so that it appears whole or not at all.
No Lightning, no process group.

Each process writing a checkpoint writes its files into a hidden staging sibling
(:func:`staging_dir`) and hashes them (:func:`file_entries`); one of them writes the manifest from
everybody's entries (:func:`write_manifest`) and :func:`commit` renames the directory into place,
so a crash at any moment leaves either no directory under the name or a complete one. Where a
directory cannot be renamed (object stores) the checkpoint is written in place and its manifest,
one object written last, commits it. Reading and checking one: :mod:`lightning_scale.core.checkpoint.format`.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightning_scale.core.checkpoint.checksums import DEFAULT_CHECKSUM, check_checksum, file_checksum, thread_pool
from lightning_scale.core.checkpoint.format import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointCorruptError,
)
from lightning_scale.core.checkpoint.storage import (
    AnyPath,
    RemotePath,
    as_path,
    renames_atomically,
    replace,
    rmtree,
    write_durable,
)

__all__ = ["clear_in_place", "commit", "file_entries", "staging_dir", "write_manifest"]


def staging_dir(final: AnyPath, token: str) -> AnyPath:
    """The hidden sibling a checkpoint is written into before :func:`commit` renames it to ``final``.
    ``token`` must be the same on every process writing it (e.g. broadcast from rank 0).

    Where directories cannot be renamed atomically (object stores), this is ``final`` itself: the
    checkpoint is written in place and its manifest, one object written last, is the commit."""
    if not re.fullmatch(r"[0-9a-zA-Z_-]+", token):
        raise ValueError(f"token={token!r} must be letters, digits, '_' or '-'.")
    final = as_path(final)
    if not renames_atomically(final):
        return final
    return final.parent / f".{final.name}.staging-{token}"


def file_entries(
    root: AnyPath,
    files: Iterable[str],
    *,
    known: Mapping[str, tuple[int, str]] | None = None,
    checksum: str = DEFAULT_CHECKSUM,
) -> list[dict[str, Any]]:
    """Manifest entries (relative path, size, and the ``checksum`` algorithm's digest under its name)
    of ``files`` (names relative to ``root``), each read once. ``known``: ``{name: (size, digest)}``
    of the same algorithm, taken while writing; used when the file on disk has that size."""
    check_checksum(checksum)
    root = as_path(root)
    files = list(files)
    paths = [root / f for f in files]
    sizes = [p.stat().st_size for p in paths]
    known = known or {}

    def digest(i: int) -> str:
        size_and_hash = known.get(files[i])
        return size_and_hash[1] if size_and_hash and size_and_hash[0] == sizes[i] else file_checksum(paths[i], checksum)

    digests = list(thread_pool("files").map(digest, range(len(paths))))  # several files hash at once
    return [
        {"path": p.resolve().relative_to(root.resolve()).as_posix(), "bytes": size, checksum: d}
        for p, size, d in zip(paths, sizes, digests)
    ]


def _fsync_dir(path: AnyPath) -> None:
    if isinstance(path, RemotePath):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(
    staging: AnyPath, entries: Sequence[Mapping[str, Any]], metadata: Mapping[str, Any]
) -> dict[str, Any]:
    """Write ``manifest.json`` into ``staging``: the files (every process's :func:`file_entries`), the
    format version, a time stamp and ``metadata`` (layout, step, versions, ...; JSON values only)."""
    paths = [e["path"] for e in entries]
    if len(set(paths)) != len(paths):
        duplicated = sorted({p for p in paths if paths.count(p) > 1})
        raise ValueError(f"Two processes listed the same checkpoint files: {duplicated[:5]}.")
    manifest = {
        # Only SHA-256 entries: exactly version 1's format, which earlier releases read too.
        "format_version": FORMAT_VERSION if any("sha256" not in e for e in entries) else 1,
        "created_unix_s": time.time(),
        **dict(metadata),
        "files": sorted((dict(e) for e in entries), key=lambda e: e["path"]),
    }
    text = json.dumps(manifest, indent=2, sort_keys=False)  # raises TypeError for non-JSON metadata
    staging = as_path(staging)
    if isinstance(staging, RemotePath):
        write_durable(staging / MANIFEST, text.encode())  # one object: there whole or not at all
        return manifest
    tmp = staging / f".{MANIFEST}.tmp"
    write_durable(tmp, text.encode())
    os.replace(tmp, staging / MANIFEST)
    _fsync_dir(staging)
    return manifest


def commit(staging: AnyPath, final: AnyPath) -> AnyPath:
    """Rename a staged checkpoint (with its manifest) to ``final``, atomically.

    An existing ``final`` (a checkpoint of the same name: ``last``, or a step saved again) is moved
    aside first and deleted only once the new one is in place, so some complete checkpoint exists
    under a name at every moment. A checkpoint written in place (``staging == final``, see
    :func:`staging_dir`) was committed by its manifest.
    """
    staging, final = as_path(staging), as_path(final)
    if not (staging / MANIFEST).is_file():
        raise CheckpointCorruptError(f"{staging} has no {MANIFEST}: write the manifest before committing.")
    if staging == final:
        return final
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.replaced-{os.getpid()}-{time.monotonic_ns()}"
        replace(final, old)
    replace(staging, final)
    _fsync_dir(final.parent)
    if old is not None:
        rmtree(old)
    return final


def clear_in_place(final: AnyPath) -> None:
    """Before a checkpoint is written in place: delete what is at ``final``, its manifest first, so
    no moment shows the old manifest beside new files."""
    final = as_path(final)
    if (final / MANIFEST).exists():
        (final / MANIFEST).unlink()
    rmtree(final)
