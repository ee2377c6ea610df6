"""A sweep job's directory: chosen by the job's config (never by its position in the sweep), claimed
before Hydra writes into it, locked while the job runs, and checked for another config's finished job.
May import from ``cli`` ``environment``, ``job_config`` and ``results`` (see ``cli/__init__.py``).

Jobs are matched to directories by their configuration (``hydra.sweep.subdir`` is
``${ls_job_dir:${hydra.job.num}}``): a job goes to the directory whose records carry its config's
fingerprint, else to ``<job number>/`` when that holds no other job, else to the next free number. So
re-running a study with its sweep values in another order finds every finished job where it is.

While a job runs, the sweep holds ``<job dir>/.lock`` (``flock``): a second sweep refuses that job,
naming the pid.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from lightning_scale.cli.environment import global_rank, launched_externally
from lightning_scale.cli.job_config import config_fingerprint
from lightning_scale.cli.results import JOB_FILE, RESULTS_FILE, read_json

__all__ = ["ConfigMismatch", "JobDirBusy", "finished_results", "hold_job_dir", "job_dir_for", "release_job_dir"]

_LOCK_FILE = ".lock"
_CLAIM_FILE = ".ls-job"  # {"config_fingerprint": ...}: written when a job claims its directory
_RUN_DIR_PLACEHOLDER = "/__lightning_scale_run_dir__"


def _task_fingerprint(root: DictConfig) -> str:
    """:func:`config_fingerprint` of the job whose Hydra config is ``root``, before its directory is
    known (its ``run_dir`` is a placeholder that the fingerprint writes as ``${run_dir}`` anyway)."""
    task = OmegaConf.masked_copy(root, [k for k in root if k != "hydra"])
    OmegaConf.set_struct(task, False)
    task.run_dir = _RUN_DIR_PLACEHOLDER
    return config_fingerprint(cast(dict, OmegaConf.to_container(task, resolve=True)))


def _recorded_fingerprint(job_dir: Path) -> str | None:
    """The config fingerprint a job directory's records carry (claim, results or job record), or None."""
    for name, key in (
        (_CLAIM_FILE, "config_fingerprint"),
        (RESULTS_FILE, "config_fingerprint"),
        (JOB_FILE, "fingerprint"),
    ):
        doc = read_json(job_dir / name)
        if doc and doc.get(key):
            return str(doc[key])
    return None


def job_dir_for(num: Any, *, _root_: DictConfig) -> str:
    """``${ls_job_dir:${hydra.job.num}}``, a job's directory name below the sweep directory, chosen by its
    config: the directory whose records carry the job's config fingerprint; else ``<num>`` when that holds
    no other job's records; else the next free number. The directory chosen is claimed (``.ls-job``)
    before Hydra writes anything into it, so jobs of one sweep never share a directory."""
    if "MULTIRUN" not in str(OmegaConf.select(_root_, "hydra.mode", default="")):
        return str(num)
    sweep_dir = Path(str(_root_.hydra.sweep.dir))
    try:
        fingerprint = _task_fingerprint(_root_)
    except Exception:  # noqa: BLE001 - a config that does not resolve fails in the job, with its own message
        return str(num)  # (and the sweep's record never overwrites another config's finished job)
    recorded: dict[str, str] = {}
    if sweep_dir.is_dir():
        for d in sorted(sweep_dir.iterdir(), key=lambda p: (len(p.name), p.name)):
            if d.is_dir() and d.name.isdigit() and (found := _recorded_fingerprint(d)) is not None:
                if found == fingerprint:
                    return d.name
                recorded[d.name] = found
    dry_run = bool(OmegaConf.select(_root_, "sweep.dry_run", default=False))
    claim = not dry_run and (not launched_externally() or global_rank() == 0)
    candidate = int(num)
    while True:
        name = str(candidate)
        if name not in recorded:
            if not claim:
                return name
            target = sweep_dir / name
            target.mkdir(parents=True, exist_ok=True)
            try:  # atomic: of two jobs wanting one free directory, one gets it
                fd = os.open(target / _CLAIM_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if _recorded_fingerprint(target) == fingerprint:
                    return name
                recorded[name] = _recorded_fingerprint(target) or "?"
            else:
                with os.fdopen(fd, "w") as out:
                    json.dump({"config_fingerprint": fingerprint}, out)
                return name
        candidate = max(candidate + 1, *(int(n) + 1 for n in recorded)) if recorded else candidate + 1


class JobDirBusy(ValueError):
    """Another live process runs the job in this directory."""


def hold_job_dir(run_dir: Path) -> int:
    """Lock ``<run_dir>/.lock`` (``flock``) for this job's life; returns the descriptor to close at its
    end (the kernel releases the lock when this process dies, whatever kills it). Raises
    :class:`JobDirBusy` naming the directory and the pid holding it."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / _LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise JobDirBusy(
            f"{run_dir} is held by process {holder} (another sweep is running this job). Wait for it to end, or "
            f"end it (kill {holder}), then run the sweep again."
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def release_job_dir(fd: int | None) -> None:
    """Let go of the lock :func:`hold_job_dir` took (None: none was taken)."""
    if fd is not None:
        os.close(fd)  # closing the only descriptor releases the flock


class ConfigMismatch(ValueError):
    """The job's directory holds a finished job of another config."""


def finished_results(run_dir: Path, fingerprint: str) -> dict[str, Any] | None:
    """The results of this config's job when it finished earlier in ``run_dir``, else None; raises
    :class:`ConfigMismatch` when the directory holds another config's finished job."""
    results = read_json(run_dir / RESULTS_FILE)
    if results and results.get("status") == "completed":
        if results.get("config_fingerprint") != fingerprint:
            raise ConfigMismatch(
                f"{run_dir} holds a finished job of another config (fingerprint {results.get('config_fingerprint')}, "
                f"this one {fingerprint}). Give this sweep its own directory with study=<a new name>."
            )
        return results
    return None
