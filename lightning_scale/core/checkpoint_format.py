"""The on-disk checkpoint format (``../shared/DESIGN.md``): one directory per checkpoint, committed
atomically, with a manifest that makes it verifiable. No Lightning, no process group.

A checkpoint is a directory such as ``checkpoints/step-000123/`` holding the shard files (DCP's
``.distcp`` files and ``.metadata``, or anything else) and ``manifest.json``, written last. It is
built in a hidden staging sibling (:func:`staging_dir`) and renamed into place by :func:`commit`
once the manifest is there, so a crash at any moment leaves either no directory or a complete one;
a directory without a valid manifest is not a checkpoint. :func:`verify` checks every file the
manifest lists (present, same size, same checksum) and names the first that is not; :func:`latest`
is the newest checkpoint under a root that verifies, warning about each broken one it passes.

Each manifest entry names its checksum algorithm as its key (:mod:`lightning_scale.core.checksums`);
version 1 manifests (SHA-256 only) still verify.

Several processes write one checkpoint: each hashes the files it wrote (:func:`file_entries`) and
one of them writes the manifest from everybody's entries (:func:`write_manifest`).
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from lightning_scale.core.checksums import CHECKSUMS, DEFAULT_CHECKSUM, check_checksum, file_checksum, thread_pool
from lightning_scale.core.storage import (
    AnyPath,
    RemotePath,
    as_path,
    renames_atomically,
    replace,
    rmtree,
    write_durable,
)

__all__ = [
    "CHECKSUMS",
    "DEFAULT_CHECKSUM",
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointCorruptError",
    "Checkpoint",
    "checkpoint_name",
    "clear_in_place",
    "check_checksum",
    "commit",
    "entry_checksum",
    "file_entries",
    "find_checkpoints",
    "latest",
    "retained",
    "scan",
    "staged_name",
    "staging_dir",
    "verify",
    "write_manifest",
]

MANIFEST = "manifest.json"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # 1: entries carry "sha256" only
_STAGING = re.compile(r"^\.(?P<name>.+)\.staging-[0-9a-zA-Z_-]+$")
_SHARD = re.compile(r"__\d+_\d+\.distcp")


class CheckpointCorruptError(RuntimeError):
    """A checkpoint directory that does not verify; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint directory and what its manifest says."""

    path: AnyPath
    step: int
    manifest: Mapping[str, Any]


def checkpoint_name(step: int) -> str:
    """``step-000123``: the directory name of the checkpoint taken after ``step`` optimizer steps."""
    if step < 0:
        raise ValueError(f"step={step} must be 0 or more.")
    return f"step-{step:06d}"


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


def is_shard_file(name: str) -> bool:
    """A DCP data file (``__<rank>_<n>.distcp``): the bulk of a checkpoint, hashed as it is loaded."""
    return bool(_SHARD.fullmatch(PurePosixPath(name).name))


def entry_checksum(entry: Mapping[str, Any], manifest: Any = MANIFEST) -> tuple[str, str]:
    """``(algorithm, hex digest)`` of a manifest entry; a ``CheckpointCorruptError`` if it has none."""
    for algorithm in CHECKSUMS:
        if isinstance(entry.get(algorithm), str):
            return algorithm, entry[algorithm]
    raise CheckpointCorruptError(f"{manifest} lists {entry.get('path')!r} without a checksum (one of {CHECKSUMS}).")


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


def write_manifest(staging: AnyPath, entries: Sequence[Mapping[str, Any]], metadata: Mapping[str, Any]) -> dict[str, Any]:
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


def _read_manifest(path: AnyPath) -> dict[str, Any]:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointCorruptError(f"{manifest_path} is missing: {path} is not a (complete) checkpoint.")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointCorruptError(f"{manifest_path} is not valid JSON ({err}).") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise CheckpointCorruptError(f"{manifest_path} has no list of files.")
    if manifest.get("format_version") not in _READABLE_VERSIONS:
        raise CheckpointCorruptError(
            f"{manifest_path} has format_version={manifest.get('format_version')!r}; this lightning-scale reads "
            f"versions {_READABLE_VERSIONS} (a newer lightning-scale wrote it: upgrade to read it)."
        )
    return manifest


def _inside(root: AnyPath, relative: Any) -> AnyPath:
    """``root / relative``, refusing a manifest path that would leave the checkpoint directory."""
    if not isinstance(relative, str) or not relative:
        raise CheckpointCorruptError(f"{root / MANIFEST} lists a file with no path: {relative!r}.")
    pure = PurePosixPath(relative)
    if pure.is_absolute() or ".." in pure.parts or "\\" in relative:
        raise CheckpointCorruptError(f"{root / MANIFEST} lists {relative!r}, a path outside the checkpoint directory.")
    return root / pure


def verify(
    path: AnyPath, *, checksums: bool | Callable[[int, Mapping[str, Any]], bool] = True
) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` after checking every file it lists: present, of the
    recorded size and (``checksums``) checksum. ``CheckpointCorruptError`` names the first bad file.

    ``checksums`` may be ``f(index, entry)``: hash only the files it selects (several processes
    sharing the work), check the others' presence and size."""
    path = as_path(path)
    manifest = _read_manifest(path)
    for index, entry in enumerate(manifest["files"]):
        file = _inside(path, entry.get("path") if isinstance(entry, dict) else None)
        if not file.is_file():
            raise CheckpointCorruptError(f"{file} is missing (listed in {path / MANIFEST}).")
        size = file.stat().st_size
        if size != entry.get("bytes"):
            raise CheckpointCorruptError(
                f"{file} has {size} bytes, the manifest says {entry.get('bytes')}: truncated or overwritten."
            )
        algorithm, expected = entry_checksum(entry, path / MANIFEST)
        hashed = checksums(index, entry) if callable(checksums) else checksums
        if hashed and file_checksum(file, algorithm) != expected:
            raise CheckpointCorruptError(f"{file} does not match its {algorithm} in {path / MANIFEST}: corrupted.")
    return manifest


def scan(root: AnyPath) -> tuple[list[Checkpoint], list[tuple[AnyPath, str]]]:
    """Committed checkpoints under ``root`` (readable manifest), and the other non-hidden directories
    holding files, with why they are not checkpoints."""
    root = as_path(root)
    good: list[Checkpoint] = []
    bad: list[tuple[AnyPath, str]] = []
    if not root.is_dir():
        return good, bad
    for child in sorted(root.iterdir()):
        if not child.is_dir() or child.is_symlink() or child.name.startswith("."):
            continue  # staging and replaced directories are hidden; a link's target is listed itself
        try:
            manifest = _read_manifest(child)
        except CheckpointCorruptError as err:
            if any(child.iterdir()):
                bad.append((child, str(err)))
            continue
        step = manifest.get("global_step")
        good.append(Checkpoint(child, step if isinstance(step, int) else -1, manifest))
    good.sort(key=lambda c: (c.step, float(c.manifest.get("created_unix_s", 0.0)), c.path.name))
    return good, bad


def find_checkpoints(root: AnyPath) -> list[Checkpoint]:
    """Committed checkpoint directories under ``root`` with a readable manifest, oldest first (by the
    manifest's ``global_step``, then its time stamp). Staging and replaced directories are skipped."""
    return scan(root)[0]


def latest(root: AnyPath) -> Checkpoint | None:
    """The newest checkpoint under ``root`` that verifies. Every broken one passed over, and every
    directory whose manifest is missing or unreadable, gets a warning naming it."""
    good, bad = scan(root)
    for path, why in bad:
        warnings.warn(f"Skipping {path}, not a checkpoint: {why}", RuntimeWarning, stacklevel=2)
    for checkpoint in reversed(good):
        try:
            verify(checkpoint.path)
        except CheckpointCorruptError as err:
            warnings.warn(f"Skipping the broken checkpoint {checkpoint.path}: {err}", RuntimeWarning, stacklevel=2)
            continue
        return checkpoint
    return None


def retained(
    checkpoints: Sequence[Checkpoint], *, keep_last: int, keep_every: int | None = None, protect: Iterable[Any] = ()
) -> tuple[list[Checkpoint], list[Checkpoint]]:
    """``(keep, delete)``: the newest ``keep_last`` (by step), those whose step is a multiple of
    ``keep_every``, and every path in ``protect`` (the checkpoint being resumed from) are kept.

    The caller passes checkpoints that verify; the newest of them is always kept, so a run never
    deletes the only good checkpoint it has.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r} must be an integer of at least 1 (the newest is always kept).")
    if keep_every is not None and (isinstance(keep_every, bool) or not isinstance(keep_every, int) or keep_every < 1):
        raise ValueError(f"keep_every={keep_every!r} must be a positive integer or None.")
    protected = {as_path(p).resolve() for p in protect}
    ordered = sorted(checkpoints, key=lambda c: c.step)
    newest = {id(c) for c in ordered[-keep_last:]}
    keep, delete = [], []
    for c in ordered:
        every = keep_every is not None and c.step >= 0 and c.step % keep_every == 0
        (keep if id(c) in newest or every or c.path.resolve() in protected else delete).append(c)
    return keep, delete


def staged_name(path: AnyPath) -> str | None:
    """The checkpoint name a staging directory is for (``None``: not a staging directory)."""
    match = _STAGING.match(as_path(path).name)
    return match.group("name") if match else None
