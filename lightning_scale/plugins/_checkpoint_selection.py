"""Which checkpoints are a run's, which one ``"latest"`` names, and which retention deletes.

A run is identified by the ``run_id`` every manifest records: the user's, else the launcher's id
of the job (:func:`run_id_from_environment`: torchrun's ``--rdzv-id``, SLURM's job id), which stays
the same when the launcher restarts or requeues the job, else a new id per process. A ``fit`` that
resumes through ``"latest"`` continues the run of the checkpoint it resumed: its manifests list that
run under ``continues``, and retention counts that run's checkpoints as its own (a restart with a
new id, a new job resuming an earlier one). One resumed from an explicit path starts a new run.

- ``"latest"``: the rule of :mod:`lightning_scale.core.checkpoint.latest` over the sharded checkpoints:
  the run's own newest that verifies (highest step); then (a new run, e.g. resuming an earlier run in a
  reused directory; a relaunch whose id changed) the run that saved most recently, its highest step
  first. Weights-only checkpoints only when weights are all that is asked for.
- Retention deletes only the run's own checkpoints, never another run's, never the one the run
  resumed from, never its newest full checkpoint.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable
from typing import Any

from lightning_scale.core.checkpoint.commit import clear_in_place
from lightning_scale.core.checkpoint.format import (
    Checkpoint,
    CheckpointCorruptError,
    by_step,
    find_checkpoints,
    is_weights_only,
    read_listed,
    retained,
    verify,
)
from lightning_scale.core.checkpoint.latest import candidates as ordered_candidates
from lightning_scale.core.checkpoint.storage import AnyPath, RemotePath, replace, rmtree
from lightning_scale.plugins._checkpoint_layout import TRAINER_STATE

__all__ = [
    "candidates",
    "new_run_id",
    "prune",
    "remove_dir",
    "restarted",
    "run_id_from_environment",
    "saved_weights_only",
]


def restarted() -> bool:
    """This process is a relaunch: torchrun's ``--max-restarts`` or a requeued SLURM job."""
    return any(int(os.environ.get(v, "0") or 0) > 0 for v in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def run_id_from_environment() -> str | None:
    """The id of the job this process belongs to, the same for every restart of it: torchrun's run id
    (``--rdzv-id``, or the one it makes for a single-node run; not its default ``"none"``, which every
    multi-node torchrun without one shares), SLURM's job id (an array task's ``<array job>_<task>``,
    as ``scontrol requeue`` names it); None outside such a launcher."""
    torchrun = os.environ.get("TORCHELASTIC_RUN_ID")
    if torchrun and torchrun != "none":
        return f"torchrun-{torchrun}"
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        return f"slurm-{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    return None


def new_run_id() -> str:
    """A run id for a process no launcher names a job for."""
    return uuid.uuid4().hex


def saved_weights_only(checkpoint: Checkpoint) -> bool:
    """Saved without optimizer state. A manifest of an earlier release does not say: its
    ``trainer_state.json`` does (unreadable: counted as full, and ``"latest"`` verifies it anyway)."""
    if "weights_only" in checkpoint.manifest:
        return is_weights_only(checkpoint)
    try:
        return "optimizer_states" not in json.loads(read_listed(checkpoint.path, checkpoint.manifest, TRAINER_STATE))
    except (CheckpointCorruptError, OSError, ValueError):
        return False


def candidates(roots: Iterable[AnyPath], *, run_ids: set[str], weights_only: bool) -> list[AnyPath]:
    """The sharded checkpoints under ``roots`` in the order ``"latest"`` tries them (the caller takes the first
    that verifies; :func:`lightning_scale.core.checkpoint.latest.candidates`, with :func:`saved_weights_only`);
    a warning names each directory that looks like a checkpoint but is not one."""
    found = ordered_candidates(
        roots, formats=("sharded",), run_ids=run_ids, weights_only=weights_only, sharded_weights_only=saved_weights_only
    )
    return [c.path for c in found]


def prune(
    root: AnyPath, *, run_ids: set[str], keep_last: int, keep_every: int | None, protect: Iterable[Any]
) -> list[AnyPath]:
    """Delete the run's checkpoints in ``root`` (those whose manifest's ``run_id`` is one of ``run_ids``:
    the run's own and the runs it continues) beyond ``keep_last``/``keep_every`` (see
    :func:`~lightning_scale.core.checkpoint.format.retained`); returns them. Another run's checkpoints
    are never touched, nor broken ones (``"latest"`` warns about those), nor ``protect``, nor the
    run's newest full checkpoint (a weights-only save cannot push out the last one that resumes)."""
    good = []
    for c in find_checkpoints(root):
        if c.manifest.get("run_id") not in run_ids:
            continue
        try:
            verify(c.path, checksums=False)
        except CheckpointCorruptError:
            continue
        good.append(c)
    full = [c for c in good if not is_weights_only(c)]
    kept = [*protect, *([max(full, key=by_step).path] if full else [])]
    _, delete = retained(good, keep_last=keep_last, keep_every=keep_every, protect=kept)
    for c in delete:
        remove_dir(c.path)
    return [c.path for c in delete]


def remove_dir(path: AnyPath) -> None:
    """Delete a checkpoint directory: hidden by a rename first, so it stops being one at once."""
    if isinstance(path, RemotePath):  # no atomic rename: the manifest goes first, so it stops being a checkpoint
        clear_in_place(path)
        return
    hidden = path.parent / f".{path.name}.removing-{os.getpid()}-{time.monotonic_ns()}"
    replace(path, hidden)
    rmtree(hidden)
