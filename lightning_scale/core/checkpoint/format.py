"""The on-disk checkpoint format (``../shared/DESIGN.md``): reading, checking and choosing
checkpoints. No Lightning, no process group.

A checkpoint is a directory such as ``checkpoints/step-000123/`` holding the shard files (DCP's
``.distcp`` files and ``.metadata``, or anything else) and ``manifest.json``, written last
(:mod:`lightning_scale.core.checkpoint.commit` writes and commits one); a directory without a valid
manifest is not a checkpoint. :func:`verify` checks every file the manifest lists (inside the
directory, present, same size, same checksum) and names the first that is not;
:func:`read_listed` reads a small file only if the manifest vouches for it, checking the bytes it
returns. Which checkpoint ``"latest"`` names: :mod:`lightning_scale.core.checkpoint.latest`.

Each manifest entry names its checksum algorithm as its key (:mod:`lightning_scale.core.checkpoint.checksums`);
version 1 manifests (SHA-256 only) still verify.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from lightning_scale.core.checkpoint.checksums import (
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    check_checksum,
    file_checksum,
    new_digest,
)
from lightning_scale.core.checkpoint.storage import AnyPath, RemotePath, as_path
from lightning_scale.core.checks import check_positive_int
from lightning_scale.core.compat import DCP_DATA_FILE

__all__ = [
    "CHECKSUMS",
    "DEFAULT_CHECKSUM",
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointCorruptError",
    "Checkpoint",
    "by_step",
    "checkpoint_name",
    "check_checksum",
    "entry_checksum",
    "find_checkpoints",
    "is_weights_only",
    "listed_entries",
    "looks_like_checkpoint",
    "read_listed",
    "read_manifest",
    "retained",
    "scan",
    "verify",
]

MANIFEST = "manifest.json"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # 1: entries carry "sha256" only


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


def is_shard_file(name: str) -> bool:
    """A DCP data file (``__<rank>_<n>.distcp``): the bulk of a checkpoint, hashed as it is loaded."""
    return bool(DCP_DATA_FILE.fullmatch(PurePosixPath(name).name))


def entry_checksum(entry: Mapping[str, Any], manifest: Any = MANIFEST) -> tuple[str, str]:
    """``(algorithm, hex digest)`` of a manifest entry; a ``CheckpointCorruptError`` if it has none."""
    for algorithm in CHECKSUMS:
        if isinstance(entry.get(algorithm), str):
            return algorithm, entry[algorithm]
    raise CheckpointCorruptError(f"{manifest} lists {entry.get('path')!r} without a checksum (one of {CHECKSUMS}).")


def read_manifest(path: AnyPath) -> dict[str, Any]:
    """The checkpoint's manifest, parsed and checked for its form (not the files it lists: :func:`verify`)."""
    path = as_path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointCorruptError(f"{manifest_path} is missing: {path} is not a (complete) checkpoint.")
    _inside(path, MANIFEST)  # not a link leading out
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
    """``root / relative``, refusing a manifest path that would leave the checkpoint directory: absolute,
    through ``..``, or (locally) through a link whose target lies outside it."""
    if not isinstance(relative, str) or not relative:
        raise CheckpointCorruptError(f"{root / MANIFEST} lists a file with no path: {relative!r}.")
    pure = PurePosixPath(relative)
    if pure.is_absolute() or ".." in pure.parts or "\\" in relative:
        raise CheckpointCorruptError(f"{root / MANIFEST} lists {relative!r}, a path outside the checkpoint directory.")
    file = root / pure
    if not isinstance(root, RemotePath):
        # The directory itself may be a link (ModelCheckpoint's save_last="link"): its target is the checkpoint.
        target, home = file.resolve(), root.resolve()
        if not target.is_relative_to(home):
            raise CheckpointCorruptError(
                f"{file} is a link to {target}, outside the checkpoint directory {home}: a checkpoint's files must lie "
                "inside it."
            )
    return file


def listed_entries(manifest: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The manifest's file entries by path."""
    return {e["path"]: e for e in manifest.get("files", []) if isinstance(e, dict) and isinstance(e.get("path"), str)}


def read_listed(path: AnyPath, manifest: Mapping[str, Any], name: str) -> bytes:
    """The bytes of the small file ``name`` of the checkpoint at ``path``, only if the ``manifest``
    lists it inside the directory, and checked against its recorded size and checksum (the bytes
    returned are the bytes checked: nothing can change them between the check and their use)."""
    path = as_path(path)
    entry = listed_entries(manifest).get(name)
    if entry is None:
        raise CheckpointCorruptError(
            f"{path / name}: {path / MANIFEST} does not list it, and a load reads only files the manifest vouches for "
            "with a checksum."
        )
    data = _inside(path, name).read_bytes()
    if len(data) != entry.get("bytes"):
        raise CheckpointCorruptError(
            f"{path / name} has {len(data)} bytes, the manifest says {entry.get('bytes')}: truncated or overwritten."
        )
    algorithm, expected = entry_checksum(entry, path / MANIFEST)
    digest = new_digest(algorithm)
    digest.update(data)
    if digest.hexdigest() != expected:
        raise CheckpointCorruptError(f"{path / name} does not match its {algorithm} in {path / MANIFEST}: corrupted.")
    return data


def verify(path: AnyPath, *, checksums: bool | Callable[[int, Mapping[str, Any]], bool] = True) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` after checking every file it lists: present, of the
    recorded size and (``checksums``) checksum. ``CheckpointCorruptError`` names the first bad file.

    ``checksums`` may be ``f(index, entry)``: hash only the files it selects (several processes
    sharing the work), check the others' presence and size."""
    path = as_path(path)
    manifest = read_manifest(path)
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


def looks_like_checkpoint(path: AnyPath) -> bool:
    """A directory holding what only a checkpoint holds (a manifest, DCP metadata, shard files): one
    that is not a valid checkpoint is reported, never passed over in silence."""
    return any(c.name in (MANIFEST, ".metadata") or is_shard_file(c.name) for c in as_path(path).iterdir())


def scan(root: AnyPath) -> tuple[list[Checkpoint], list[tuple[AnyPath, str]]]:
    """Committed checkpoints under ``root`` (readable manifest), and the other non-hidden directories
    that look like checkpoints (:func:`looks_like_checkpoint`), with why they are not ones."""
    root = as_path(root)
    good: list[Checkpoint] = []
    bad: list[tuple[AnyPath, str]] = []
    if not root.is_dir():
        return good, bad
    for child in sorted(root.iterdir()):
        if not child.is_dir() or child.is_symlink() or child.name.startswith("."):
            continue  # staging and replaced directories are hidden; a link's target is listed itself
        try:
            manifest = read_manifest(child)
        except CheckpointCorruptError as err:
            if looks_like_checkpoint(child):
                bad.append((child, str(err)))
            continue
        step = manifest.get("global_step")
        good.append(Checkpoint(child, step if isinstance(step, int) else -1, manifest))
    good.sort(key=lambda c: (*by_step(c), c.path.name))
    return good, bad


def _written(checkpoint: Checkpoint) -> float:
    """When the checkpoint was committed (its manifest's time stamp; 0 if it has none)."""
    value = checkpoint.manifest.get("created_unix_s")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def by_step(checkpoint: Checkpoint) -> tuple[int, float]:
    """Sort key of one run's checkpoints, oldest first: the step, then the commit time (saves of one step)."""
    return checkpoint.step, _written(checkpoint)


def find_checkpoints(root: AnyPath) -> list[Checkpoint]:
    """Committed checkpoint directories under ``root`` with a readable manifest, oldest first (by the
    manifest's ``global_step``, then its time stamp). Staging and replaced directories are skipped."""
    return scan(root)[0]


def is_weights_only(checkpoint: Checkpoint) -> bool:
    """Saved with the weights only (``ModelCheckpoint(save_weights_only=True)``): no optimizer state, so
    it cannot resume training. Manifests of earlier releases do not say (their checkpoints count as full)."""
    return checkpoint.manifest.get("weights_only") is True


def retained(
    checkpoints: Sequence[Checkpoint], *, keep_last: int, keep_every: int | None = None, protect: Iterable[Any] = ()
) -> tuple[list[Checkpoint], list[Checkpoint]]:
    """``(keep, delete)``: the newest ``keep_last`` (by step, then commit time), those whose step is a multiple of
    ``keep_every``, and every path in ``protect`` (the checkpoint being resumed from) are kept.

    The caller passes checkpoints that verify; the newest of them is always kept, so a run never
    deletes the only good checkpoint it has.
    """
    check_positive_int("keep_last", keep_last, fix="The newest checkpoint is always kept.")
    if keep_every is not None:
        check_positive_int("keep_every", keep_every, fix="Or None: keep only the newest keep_last.")
    protected = {as_path(p).resolve() for p in protect}
    ordered = sorted(checkpoints, key=by_step)
    newest = {id(c) for c in ordered[-keep_last:]}
    keep, delete = [], []
    for c in ordered:
        every = keep_every is not None and c.step >= 0 and c.step % keep_every == 0
        (keep if id(c) in newest or every or c.path.resolve() in protected else delete).append(c)
    return keep, delete


# ----------------------------------------------------------------------------- deprecated (0.1.0's "latest")


def _the_rule() -> Any:
    # By name: the rule's module imports this one (its checkpoints, their verification); only the deprecated
    # paths below call back into it.
    return importlib.import_module("lightning_scale.core.checkpoint.latest")


def _deprecated(name: str) -> None:
    import warnings

    from lightning_scale.core.deprecation import moved_message

    new = f"lightning_scale.core.checkpoint.latest.{name}"
    warnings.warn(moved_message(f"{__name__}.{name}", new), DeprecationWarning, stacklevel=3)


def resume_order(checkpoints: Sequence[Checkpoint], *, run_ids: Iterable[str] = ()) -> list[Checkpoint]:
    """Deprecated: :func:`lightning_scale.core.checkpoint.latest.resume_order` (the one rule of "latest", over
    every format). ``checkpoints`` in the order that rule tries them."""
    _deprecated("resume_order")
    rule = _the_rule()

    as_candidates = {id(c): rule.sharded_candidate(c) for c in checkpoints}
    order = rule.resume_order(list(as_candidates.values()), run_ids=run_ids)
    by_candidate = {id(as_candidates[id(c)]): c for c in checkpoints}
    return [by_candidate[id(c)] for c in order]


def latest(root: AnyPath, *, run_ids: Iterable[str] = (), weights_only: bool = False) -> Checkpoint | None:
    """Deprecated: :func:`lightning_scale.core.checkpoint.latest.latest` (``latest([root], formats=("sharded",))``).
    The sharded checkpoint "latest" names under ``root``, as 0.1.0 returned it."""
    _deprecated("latest")
    rule = _the_rule()

    found = rule.latest([root], formats=("sharded",), run_ids=run_ids, weights_only=weights_only)
    return None if found is None else Checkpoint(found.path, found.step, found.manifest)
