"""Hydra multirun of multi-process jobs: ``lightning-scale-train -m strategy.tensor_parallel=1,2 ...``.

Lightning's launcher inside a multirun re-runs the whole sweep in every child (Lightning #11300),
and the sweeping process keeps ``LOCAL_RANK`` and its process group after the first job. Here the
sweeping process never trains: for each job it checks the config (a layout that does not fit is
*skipped*, with the reason, before any process starts), writes the job's resolved config into the
job's own directory, and starts the job's ranks with ``torchrun``; the ranks load that file and
never compose (or date) a config of their own. A failing job is recorded and the sweep goes on;
the sweep's exit status is the number of jobs that failed.

Under ``hydra/launcher=submitit_slurm`` with ``tasks_per_node`` > 1, ``srun`` starts every rank
of a job: each runs its job in-process (SLURM gives the ranks), and rank 0 keeps the record.

A sweep's directory is ``multirun/<study>``, where the study is named by the experiment and a hash
of the command line's overrides (or ``study=<name>``): the same command finds the same directory,
so re-running an interrupted sweep skips the jobs that finished (``results.json`` with status
``completed`` and the same config) and resumes the others from their newest checkpoint, in the
same wandb run.

Jobs are matched to directories by their configuration, never by position (``sweep_dirs.py``).

``sweep.dry_run=true`` lists every job with what the sweep would do (start, resume, skip, fail,
refuse) and launches nothing; while a job runs, its status (step, loss, tokens/s, ETA, log path) is
printed every ``sweep.progress_every_s`` seconds.

A job's processes die with the sweep, on any signal including SIGKILL (``sweep_launch.py``). While a
job runs, the sweep holds ``<job dir>/.lock`` (``flock``): a second sweep refuses that job, naming the pid.

This module runs the jobs one by one (:func:`run_job`) and sums them up (:class:`SweepSummary`). It may
import from ``cli`` every module of the chain below it: ``environment``, ``job_config``, ``results``,
``resume``, ``run``, ``sweep_dirs`` and ``sweep_launch`` (see ``cli/__init__.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lightning_scale.cli.environment import global_rank, launched_externally, own_process
from lightning_scale.cli.job_config import (
    LayoutNotAdmitted,
    check_fits,
    config_fingerprint,
    layout_of,
    preflight,
    world_size,
)
from lightning_scale.cli.results import (
    JOB_FILE,
    RESULTS_FILE,
    STATUSES,
    collect_results,
    describe_totals,
    read_json,
    study_totals,
    write_json,
)
from lightning_scale.cli.resume import resumable_checkpoint
from lightning_scale.cli.run import prepare_job, run
from lightning_scale.cli.sweep_dirs import ConfigMismatch, JobDirBusy, finished_results, hold_job_dir, release_job_dir
from lightning_scale.cli.sweep_launch import LOG_FILE, PROGRESS_EVERY_S, say, tail, torchrun
from lightning_scale.core.deprecation import moved_names

__all__ = ["SweepSummary", "check_sweep_options", "failed_jobs", "run_job"]

# 0.1.0 exported these from here; they went down the chain (issue 25).
__getattr__ = moved_names(
    __name__,
    {
        "die_with_parent": "lightning_scale.cli.environment.die_with_parent",
        "job_dir_for": "lightning_scale.cli.sweep_dirs.job_dir_for",
        "study_name": "lightning_scale.cli.environment.study_name",
    },
)

_FAILED: list[int] = []  # failed jobs of the last multirun in this process (the exit status)
# Jobs of this process's multirun that ended without a record of their own (refused: another process holds
# the directory, or it holds another config's finished job): the summary lists them, nothing is written.
_UNRECORDED: list[dict[str, Any]] = []
_DRY_RUN: list[dict[str, Any]] = []  # what a dry run would do, one row per job


def run_job(cfg: DictConfig, resolved: DictConfig, job: dict[str, Any]) -> dict[str, Any]:
    """One job of a multirun; never raises (a failure is recorded and the sweep goes on)."""
    run_dir = Path(resolved.run_dir)
    if run_dir.name.isdigit():  # the job's number is its directory's (chosen by config, see job_dir_for)
        job["hydra_num"], job["num"] = job.get("num"), int(run_dir.name)
    label = f"job {job['num']}"
    start = time.monotonic()
    dry_run = bool(OmegaConf.select(resolved, "sweep.dry_run", default=False))
    job["fingerprint"] = config_fingerprint(cast(dict, OmegaConf.to_container(resolved)))
    try:
        try:  # a layout these processes, this machine or the model cannot take: skipped, with the reason
            job["layout"] = layout_of(resolved, job.get("strategy_choice"))
            label = f"job {job['num']} ({job['layout']['name']})"
            check_fits(resolved)
        except ValueError as err:
            raise LayoutNotAdmitted(str(err)) from None
        preflight(resolved)  # any other bad input fails the job before a process starts
    except LayoutNotAdmitted as err:
        if dry_run:
            return _plan(run_dir, job, "skip", str(err))
        say(f"{label}: skipped: {err}")
        return _record(run_dir, job, "skipped", reason=str(err))
    except ValueError as err:
        if dry_run:
            return _plan(run_dir, job, "fail", str(err))
        say(f"{label}: failed: {err}")
        return _record(run_dir, job, "failed", reason=str(err))
    if dry_run:
        return _dry_run(resolved, run_dir, job)
    lock = None
    try:
        lock = hold_job_dir(run_dir)
        done = finished_results(run_dir, job["fingerprint"])
        if done is not None:
            say(f"{label}: finished earlier, skipped ({run_dir / RESULTS_FILE})")
            return done
        prepare_job(resolved, job)
        load_start = os.getloadavg()[0]  # before this job's processes: what else the machine was doing
        if launched_externally() or (own_process() and world_size(resolved) == 1):
            # srun started every rank of this job, or this process is the job's alone (a submitit
            # job of one device): train here.
            say(f"{label}: started in {run_dir}")
            run(resolved)
            code = 0
        else:
            config_file = run_dir / "resolved_config.yaml"
            OmegaConf.save(resolved, config_file)
            say(f"{label}: started; log: {run_dir / LOG_FILE}")
            code = torchrun(resolved, config_file, run_dir / LOG_FILE, label)
    except (JobDirBusy, ConfigMismatch) as err:  # the directory is not this job's to write: nothing is written
        say(f"{label}: refused: {err}")
        doc = {
            "status": "failed",
            "job": job.get("num"),
            "layout": job.get("layout", {}).get("name"),
            "reason": str(err),
            "overrides": job.get("overrides"),
            "job_dir": str(run_dir),
        }
        _UNRECORDED.append(doc)
        return doc
    except Exception as err:  # noqa: BLE001 - a failed job is recorded, the sweep goes on
        say(f"{label}: failed: {err!r}")
        return _record(run_dir, job, "failed", reason=repr(err), elapsed_s=round(time.monotonic() - start, 1))
    finally:
        release_job_dir(lock)
    results = read_json(run_dir / RESULTS_FILE) or {}
    if code != 0 or results.get("status") != "completed" or results.get("config_fingerprint") != job["fingerprint"]:
        reason = f"exit code {code}" + ("" if code else ", no results.json")
        say(f"{label}: failed ({reason}); log: {run_dir / LOG_FILE}\n{tail(run_dir / LOG_FILE)}")
        return _record(run_dir, job, "failed", reason=reason, elapsed_s=round(time.monotonic() - start, 1))
    # The report warns when a job started on a busy machine: its throughput is noise.
    results["load_average"] = {"start": load_start, "end": os.getloadavg()[0]}
    results["cpu_count"] = os.cpu_count()
    write_json(run_dir / RESULTS_FILE, results)
    rate = results.get("tokens_per_sec")
    say(f"{label}: completed in {time.monotonic() - start:.0f} s" + (f", {rate:,.0f} tokens/s" if rate else ""))
    return results


def _record(run_dir: Path, job: Mapping[str, Any], status: str, **extra: Any) -> dict[str, Any]:
    doc = {
        "status": status,
        "study": job.get("study"),
        "job": job.get("num"),
        "layout": job.get("layout", {}).get("name"),
        "layout_sizes": job.get("layout"),
        "overrides": job.get("overrides"),
        "config_fingerprint": job.get("fingerprint"),
        **extra,
    }
    if global_rank() == 0:
        existing = read_json(run_dir / RESULTS_FILE) or {}
        if existing.get("status") == "completed" and existing.get("config_fingerprint") != doc["config_fingerprint"]:
            _UNRECORDED.append({**doc, "job_dir": str(run_dir)})  # never overwrite another config's finished job
            return doc
        if (
            all(existing.get(k) == doc.get(k) for k in ("config_fingerprint", "status", "reason"))
            and status == "skipped"
        ):
            return existing  # the same verdict on the same config: the record stands as written
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / RESULTS_FILE, doc)
    return doc


def _plan(run_dir: Path, job: dict[str, Any], action: str, reason: str) -> dict[str, Any]:
    """A dry run's line for one job: what the sweep would do, and why."""
    row = {
        "job": job.get("num"),
        "dir": str(run_dir),
        "action": action,
        "layout": (job.get("layout") or {}).get("name"),
        "overrides": job.get("overrides"),
        "reason": reason,
    }
    _DRY_RUN.append(row)
    say(f"dry run: job {job.get('num')} ({row['layout'] or '?'}): {action}: {reason}")
    _forget_unused_dir(run_dir)
    return row


def _dry_run(resolved: DictConfig, run_dir: Path, job: dict[str, Any]) -> dict[str, Any]:
    """What a real run would do with an admitted job: skip it (finished), resume it, or start it."""
    results = read_json(run_dir / RESULTS_FILE) or {}
    if results.get("status") == "completed":
        if results.get("config_fingerprint") != job["fingerprint"]:
            return _plan(run_dir, job, "refuse", f"{run_dir} holds a finished job of another config")
        return _plan(run_dir, job, "skip", f"finished earlier ({run_dir / RESULTS_FILE})")
    try:
        release_job_dir(hold_job_dir(run_dir)) if run_dir.is_dir() else None
    except JobDirBusy as err:
        return _plan(run_dir, job, "refuse", str(err))
    checkpoint, _ = resumable_checkpoint(resolved)
    world = world_size(resolved)
    if checkpoint is not None:
        return _plan(run_dir, job, "resume", f"from {checkpoint} on {world} process(es)")
    return _plan(run_dir, job, "start", f"{world} process(es), {resolved.trainer.get('max_steps')} steps")


def _forget_unused_dir(run_dir: Path) -> None:
    """A dry run leaves no job directory behind that Hydra created for it (only ``.hydra`` and an
    empty log inside); a directory holding any record of a job stays."""
    if not run_dir.is_dir():
        return
    names = {p.name for p in run_dir.iterdir()}
    if names <= {".hydra", "train.log"} and (
        not (run_dir / "train.log").exists() or (run_dir / "train.log").stat().st_size == 0
    ):
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)


def failed_jobs() -> int:
    """Jobs that failed in the last multirun of this process (``lightning-scale-train``'s exit status)."""
    return _FAILED[-1] if _FAILED else 0


def check_sweep_options(cfg: DictConfig) -> None:
    """``ValueError``/``TypeError`` for a bad ``sweep.*`` option, before any job starts."""
    options = cfg.get("sweep") or {}
    dry_run = options.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise TypeError(f"sweep.dry_run={dry_run!r} is not a boolean. Pass sweep.dry_run=true or sweep.dry_run=false.")
    every = options.get("progress_every_s", PROGRESS_EVERY_S)
    if isinstance(every, bool) or not isinstance(every, (int, float)) or not every > 0:
        raise ValueError(
            f"sweep.progress_every_s={every!r} must be a number of seconds > 0 (how often a running job's status "
            f"is printed). Pass e.g. sweep.progress_every_s={PROGRESS_EVERY_S:g}."
        )


class SweepSummary(Callback):
    """Hydra callback: at the end of a multirun, print one line per job (status, layout, tokens/s
    or the reason), write ``<sweep dir>/sweep.json`` and set the exit status to the failed count.
    After a dry run (``sweep.dry_run=true``) it prints what each job would do and writes nothing."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_sweep_options(config)  # before any job starts
        _UNRECORDED.clear()
        _DRY_RUN.clear()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        if OmegaConf.select(config, "sweep.dry_run", default=False):
            _FAILED.append(0)
            counts: dict[str, int] = {}
            for row in _DRY_RUN:
                counts[row["action"]] = counts.get(row["action"], 0) + 1
            print(
                f"[sweep] dry run of {sweep_dir}: {len(_DRY_RUN)} jobs ("
                + ", ".join(f"{n} {a}" for a, n in counts.items())
                + "); nothing was launched",
                flush=True,
            )
            for row in _DRY_RUN:
                print(
                    f"[sweep]   {Path(row['dir']).name:>4} {row['action']:<8} {row['layout'] or '':<16} {row['reason']}",
                    flush=True,
                )
            if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= {"multirun.yaml"}:
                import shutil

                shutil.rmtree(sweep_dir, ignore_errors=True)  # a new study: the dry run leaves nothing behind
            return
        job_dirs = (
            [p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")] if sweep_dir.is_dir() else []
        )
        results = {Path(r["job_dir"]).resolve(): r for r in collect_results(sweep_dir)}
        refused = {Path(r["job_dir"]).resolve(): r for r in _UNRECORDED}
        rows = []
        for job_dir in sorted(
            job_dirs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)
        ):
            doc = refused.get(job_dir.resolve()) or results.get(job_dir.resolve())
            if doc is None and not (job_dir / ".hydra").is_dir() and not (job_dir / JOB_FILE).is_file():
                continue  # not a job directory (e.g. the report)
            doc = doc or {"status": "failed", "reason": f"no {RESULTS_FILE} (the job did not finish)"}
            rows.append(
                {"dir": job_dir.name, **{k: doc.get(k) for k in ("status", "layout", "tokens_per_sec", "reason")}}
            )
        counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
        _FAILED.append(counts["failed"])
        totals = study_totals(list(results.values()))
        write_json(
            sweep_dir / "sweep.json", {"study": config.get("study"), "counts": counts, "totals": totals, "jobs": rows}
        )
        print(
            f"[sweep] {sweep_dir}: "
            + ", ".join(f"{n} {s}" for s, n in counts.items())
            + f"; {describe_totals(totals)}",
            flush=True,
        )
        for r in rows:
            detail = f"{r['tokens_per_sec']:,.0f} tokens/s" if r.get("tokens_per_sec") else (r.get("reason") or "")
            print(f"[sweep]   {r['dir']:>4} {r['status']:<9} {r.get('layout') or '':<16} {detail}", flush=True)
        if rows:
            print(f"[sweep] report: lightning-scale-report {sweep_dir}", flush=True)
