"""Which checkpoint ``"latest"`` names: one rule for every format and every caller (the strategy's
``ckpt_path="latest"`` and automatic resume, the app's ``ckpt_path=latest`` under Lightning's strategies,
a sweep resuming a job). No Lightning, no process group.

**The rule.** Of the checkpoints under the roots, in a format the caller can load and (unless weights
are all it asks for) holding training state, ``"latest"`` is the first that verifies in this order:

1. the run's own (a sharded checkpoint whose manifest's ``run_id`` is one of ``run_ids``: this run and
   the runs it continues), highest step first;
2. then every other run's, the run that saved most recently first, each run's highest step first.

Equal steps: the newer save first. Each checkpoint passed over, and each that looks like one but cannot
be read, gets a warning naming it and why.

*Steps inside a run, not times*: a step is what the checkpoint holds, while a file's modification time
says when it was last written, by a save or by ``cp``, ``rsync`` or a restore from backup: a copied old
checkpoint must not pass the newest one. *Times across runs, not steps*: steps of two runs do not
compare: a run started again from scratch in a reused directory has lower steps than the run before it,
and is the one to continue. A run's time is its newest save: a sharded checkpoint's manifest records
when it was committed (``created_unix_s``, which a copy keeps); a Lightning ``.ckpt`` file records no
time and no run, so the ``.ckpt`` files of a directory count as one run, timed by their files'
modification times.

**Formats** (:data:`FORMATS`):

- ``"sharded"``: a directory with a manifest (:mod:`.format`). It verifies when every file its manifest
  lists is present, of its size and checksum (:func:`~lightning_scale.core.checkpoint.format.verify`).
  Weights only: its manifest says so.
- ``"lightning"``: a ``*.ckpt`` file ``torch.save`` wrote (Lightning's ``ModelCheckpoint``, any name:
  ``epoch=0-step=10.ckpt``, ``last.ckpt``; a link counts once, as its target). It verifies when the
  CRC-32 of every record of its zip archive matches (``torch.save`` writes them; ``torch.load`` does not
  check them) and its header loads with ``torch.load(weights_only=True)`` (no code runs) as a dict.
  Its step: ``global_step``. Weights only: no ``optimizer_states`` or no ``loops``.
"""

from __future__ import annotations

import math
import pickle
import warnings
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from lightning_scale.core.checkpoint.format import Checkpoint, CheckpointCorruptError, by_step, is_weights_only, scan
from lightning_scale.core.checkpoint.format import verify as verify_sharded
from lightning_scale.core.checkpoint.storage import AnyPath, as_path
from lightning_scale.core.checks import format_choices

__all__ = [
    "FORMATS",
    "Candidate",
    "candidates",
    "first_that_verifies",
    "latest",
    "resume_order",
    "sharded_candidate",
    "verify_candidate",
]

FORMATS = ("sharded", "lightning")
"""The checkpoint formats ``"latest"`` knows: ``"sharded"`` directories and Lightning's ``"lightning"`` files."""

T = TypeVar("T")


@dataclass(frozen=True)
class Candidate:
    """A checkpoint ``"latest"`` may name: what its manifest or header says."""

    path: AnyPath
    format: str
    step: int
    saved_s: float
    """When it was saved (a manifest's ``created_unix_s``; a ``.ckpt`` file's modification time)."""
    run_id: str | None
    weights_only: bool
    manifest: Mapping[str, Any] = field(default_factory=dict)
    """A sharded checkpoint's manifest (empty for a ``.ckpt`` file)."""

    def __str__(self) -> str:
        return str(self.path)


def _check_formats(formats: Iterable[str]) -> tuple[str, ...]:
    formats = tuple(formats)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(f"formats={formats!r}: pass one or more of {format_choices(FORMATS)}.")
    return formats


def _sharded(root: AnyPath, weights_only_of: Callable[[Checkpoint], bool], warn: bool) -> list[Candidate]:
    good, bad = scan(root)
    for path, why in bad:
        _warn(warn, f"Skipping {path}, not a checkpoint: {why}")
    return [sharded_candidate(c, weights_only_of) for c in good]


def sharded_candidate(
    checkpoint: Checkpoint, weights_only_of: Callable[[Checkpoint], bool] = is_weights_only
) -> Candidate:
    """A sharded checkpoint as ``"latest"`` weighs it (its manifest's step, save time and run)."""
    run_id = checkpoint.manifest.get("run_id")
    run = run_id if isinstance(run_id, str) else None
    return Candidate(
        checkpoint.path,
        "sharded",
        checkpoint.step,
        by_step(checkpoint)[1],
        run,
        weights_only_of(checkpoint),
        checkpoint.manifest,
    )


def _header(path: Path) -> dict[str, Any]:
    """A ``.ckpt`` file's pickled structure (memory-mapped: the tensors are not read)."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise CheckpointCorruptError(f"{path} does not load: {type(err).__name__}: {str(err)[:300]}") from None
    if not isinstance(state, dict):
        raise CheckpointCorruptError(f"{path} holds a {type(state).__name__}, not a Lightning checkpoint's dict.")
    return state


def _lightning(root: AnyPath, warn: bool, seen: set[Path]) -> list[Candidate]:
    if not isinstance(root, Path) or not root.is_dir():
        return []  # a .ckpt file is read with torch.load: local files only
    found = []
    for file in sorted(root.glob("*.ckpt")):
        real = file.resolve()  # last.ckpt may be a link to a checkpoint listed too
        if file.name.startswith(".") or not real.is_file() or real in seen:
            continue
        seen.add(real)
        try:
            state = _header(real)
        except CheckpointCorruptError as err:
            _warn(warn, f"Skipping a file that is not a checkpoint: {err}")
            continue
        step = state.get("global_step")
        step = step if isinstance(step, int) and not isinstance(step, bool) else -1
        weights_only = not {"optimizer_states", "loops"} <= state.keys()
        found.append(Candidate(real, "lightning", step, real.stat().st_mtime, None, weights_only))
    return found


def resume_order(found: Sequence[Candidate], *, run_ids: Iterable[str] = ()) -> list[Candidate]:
    """``found`` in the order ``"latest"`` tries them (the module's rule): the run's own first, then the
    run that saved most recently; inside a run by step, then by time."""
    runs = set(run_ids)
    last_save: dict[str | None, float] = {}
    for c in found:
        last_save[c.run_id] = max(last_save.get(c.run_id, -math.inf), c.saved_s)
    return sorted(found, key=lambda c: (c.run_id in runs, last_save[c.run_id], c.step, c.saved_s), reverse=True)


def candidates(
    roots: Iterable[AnyPath],
    *,
    formats: Iterable[str] = FORMATS,
    run_ids: Iterable[str] = (),
    weights_only: bool = False,
    sharded_weights_only: Callable[[Checkpoint], bool] = is_weights_only,
    warn: bool = True,
) -> list[Candidate]:
    """The checkpoints of ``formats`` under ``roots`` in the order ``"latest"`` tries them
    (:func:`resume_order`), those without training state left out unless ``weights_only``; not verified
    yet (:func:`first_that_verifies`). ``sharded_weights_only``: whether a sharded checkpoint holds weights
    only (default: its manifest says so). ``warn``: a warning names each file or directory that looks like
    a checkpoint but cannot be read."""
    formats = _check_formats(formats)
    found: list[Candidate] = []
    seen: set[Path] = set()
    for root in dict.fromkeys(as_path(r) for r in roots):
        if "sharded" in formats:
            found += _sharded(root, sharded_weights_only, warn)
        if "lightning" in formats:
            found += _lightning(root, warn, seen)
    usable = [c for c in found if weights_only or not c.weights_only]
    return resume_order(usable, run_ids=run_ids)


def verify_candidate(candidate: Candidate) -> None:
    """``CheckpointCorruptError`` naming what is wrong unless ``candidate`` verifies (see the module)."""
    if candidate.format == "sharded":
        verify_sharded(candidate.path)
        return
    path = Path(str(candidate.path))
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile) as err:
        raise CheckpointCorruptError(f"{path} is not a readable zip archive ({err}).") from None
    if bad is not None:
        raise CheckpointCorruptError(f"{path}: the record {bad!r} does not match its CRC-32: corrupted.")
    _header(path)


def first_that_verifies(
    ordered: Iterable[T], verify: Callable[[T], Any] = verify_candidate, *, warn: bool = True
) -> T | None:
    """The first of ``ordered`` that ``verify`` passes (it raises ``CheckpointCorruptError`` otherwise); a
    warning names each one passed over and why."""
    for item in ordered:
        try:
            verify(item)
        except CheckpointCorruptError as err:
            _warn(warn, f"Skipping the broken checkpoint {item}: {err}")
            continue
        return item
    return None


def latest(
    roots: Iterable[AnyPath],
    *,
    formats: Iterable[str] = FORMATS,
    run_ids: Iterable[str] = (),
    weights_only: bool = False,
    sharded_weights_only: Callable[[Checkpoint], bool] = is_weights_only,
    warn: bool = True,
) -> Candidate | None:
    """The checkpoint ``"latest"`` names under ``roots``: of the checkpoints of ``formats`` there that hold
    training state (any, with ``weights_only``), the first that verifies in this order: the run's own
    (``run_ids``) highest step first, then the other runs', the run that saved most recently first, each
    highest step first; equal steps, the newer save first. None when none verifies. The module's
    docstring gives the reasons and what verifies means for each format; :func:`candidates` and
    :func:`first_that_verifies` are its two halves (a process group verifies collectively in between)."""
    found = candidates(
        roots,
        formats=formats,
        run_ids=run_ids,
        weights_only=weights_only,
        sharded_weights_only=sharded_weights_only,
        warn=warn,
    )
    return first_that_verifies(found, warn=warn)


def _warn(warn: bool, message: str) -> None:
    if warn:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
