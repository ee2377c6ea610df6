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
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import string
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lightning_scale.cli.launch import global_rank, launched_externally

__all__ = [
    "JOB_FILE",
    "RESULTS_FILE",
    "STATUSES",
    "SweepSummary",
    "collect_results",
    "config_fingerprint",
    "failed_jobs",
    "layout_of",
    "run_job",
    "study_name",
]

RESULTS_FILE = "results.json"
JOB_FILE = "job.json"
STATUSES = ("completed", "skipped", "failed")
_LOG_FILE = "job.log"
ORPHAN_WATCH_ENV = "LIGHTNING_SCALE_WATCH_PARENT"
_FAILED: list[int] = []  # failed jobs of the last multirun in this process (the exit status)
_VOLATILE = ("run_dir", "ckpt_path", "job")  # differ between attempts of one job


def study_name() -> str:
    """``${ls_study:}``: ``<experiment>-<hash of the command line's overrides>`` (``sweep-...`` for a
    multirun without an experiment, ``run-...`` for a single run).

    It is made from ``sys.argv``, the one thing every job of a sweep shares: a job's config holds
    only its own overrides. The resolver is cached, and Hydra copies the sweeping process's
    resolver cache into each job's config, so a job in another process (submitit) gets the name too.
    """
    args = sys.argv[1:]
    overrides = sorted(a for a in args if "=" in a and not a.startswith(("-", "hydra.", "hydra/", "study=")))
    experiment = next((a.split("=", 1)[1] for a in overrides if a.startswith("experiment=")), None)
    multirun = any(a in ("-m", "--multirun") for a in args)
    digest = hashlib.sha1(json.dumps(overrides).encode()).hexdigest()[:8]
    return f"{experiment or ('sweep' if multirun else 'run')}-{digest}"


def wandb_offline() -> bool:
    """``${ls_wandb_offline:}``: offline unless ``WANDB_MODE`` says otherwise or the user is logged
    in (``WANDB_API_KEY``, or ``wandb login``'s entry in ``~/.netrc``)."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode in ("offline", "dryrun")
    if os.environ.get("WANDB_API_KEY"):
        return False
    try:
        import netrc

        return netrc.netrc().authenticators("api.wandb.ai") is None
    except (OSError, netrc.NetrcParseError):
        return True


def _world_size(cfg: Mapping[str, Any]) -> int:
    from lightning_scale.cli.train import _device_count

    trainer = cfg["trainer"]
    return _device_count(trainer.get("devices", 1), str(trainer.get("accelerator", "cpu"))) * int(
        trainer.get("num_nodes", 1)
    )


def layout_of(cfg: Mapping[str, Any], strategy_choice: str | None = None) -> dict[str, Any]:
    """The job's layout from its config alone: sizes, data-parallel mode and a short name
    (``dp2-tp1-pp1``; ``fsdp2-tp2-pp1``; ``ddp-x2`` for Lightning's own strategies). Raises
    ``ValueError`` when the sizes do not fit the processes."""
    from lightning_scale.core.layout import resolve_layout

    world = _world_size(cfg)
    strategy = cfg.get("strategy") or {}
    target = str(strategy.get("_target_", ""))
    if target.endswith("HybridParallelStrategy"):
        devices = world // int(cfg["trainer"].get("num_nodes", 1))
        layout = resolve_layout(
            world,
            data_parallel=strategy.get("data_parallel", "auto"),
            tensor_parallel=strategy.get("tensor_parallel", 1),
            pipeline_parallel=strategy.get("pipeline_parallel", 1),
            devices_per_node=devices,
        )
        mode = str(strategy.get("data_parallel_mode", "ddp"))
        prefix = "dp" if mode == "ddp" else mode
        return {
            "name": f"{prefix}{layout.dp}-tp{layout.tp}-pp{layout.pp}",
            "dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "mode": mode, "world_size": world,
        }  # fmt: skip
    name = strategy_choice or target.rsplit(".", 1)[-1].removesuffix("Strategy").lower() or "single"
    return {"name": f"{name}-x{world}", "dp": world, "tp": 1, "pp": 1, "mode": name, "world_size": world}


def config_fingerprint(cfg: Mapping[str, Any]) -> str:
    """A hash of a job's resolved config without what changes between attempts of the same job,
    and with its directory written as ``${run_dir}`` (a sweep directory may be moved)."""
    plain = {k: v for k, v in cfg.items() if k not in _VOLATILE}
    text = json.dumps(plain, sort_keys=True, default=str)
    if cfg.get("run_dir"):
        text = text.replace(str(cfg["run_dir"]), "${run_dir}")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _write_json(path: Path, doc: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _own_process() -> bool:
    """This process was started for this one job (submitit's local or SLURM executor), not the
    sweeping process that runs every job in turn."""
    return "SUBMITIT_LOCAL_JOB_ID" in os.environ or "SLURM_JOB_ID" in os.environ


def _check_fits(cfg: DictConfig) -> None:
    """``ValueError`` when the job's processes do not fit this machine or launcher (it is skipped)."""
    trainer = cfg.trainer
    accelerator = str(trainer.get("accelerator", "cpu"))
    if accelerator in ("gpu", "cuda"):
        import torch

        devices = _world_size(cfg) // int(trainer.get("num_nodes", 1))
        have = torch.cuda.device_count()
        if devices > have:
            raise ValueError(f"trainer.devices={devices} but this machine has {have} GPU(s).")
    if int(trainer.get("num_nodes", 1)) > 1 and not launched_externally():
        raise ValueError(
            f"trainer.num_nodes={trainer.num_nodes} needs that many machines: run the sweep with "
            "hydra/launcher=submitit_slurm (srun starts every rank)."
        )


def _resumable_checkpoint(cfg: DictConfig) -> tuple[str | None, str | None]:
    """(checkpoint to resume from, the wandb run id it records) for a job that ran before."""
    node = (cfg.get("callbacks") or {}).get("checkpoint") or {}
    root = Path(node.get("dirpath") or Path(cfg.run_dir) / "checkpoints")
    if not root.is_dir():
        return None, None
    from lightning_scale.core.checkpoint_format import latest

    found = latest(root)  # sharded checkpoints: the newest that verifies
    if found is not None:
        return str(found.path), found.manifest.get("wandb_run_id")
    last = root / "last.ckpt"
    if last.is_file():
        return str(last), None
    files = sorted(root.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    return (str(files[-1]) if files else None), None


def _wandb_loggers(cfg: DictConfig) -> list[Any]:
    loggers = cfg.get("logger") or {}
    return [node for node in loggers.values() if node is not None and str(node.get("_target_", "")).endswith("WandbLogger")]


def _new_run_id() -> str:
    return "".join(random.SystemRandom().choices(string.ascii_lowercase + string.digits, k=8))


def prepare_job(cfg: DictConfig, job: dict[str, Any]) -> None:
    """Fill in what each job (or single run) needs before it starts: the wandb run (one per job,
    group = study, job type = layout, the id kept across resumes) and, for a job that ran before,
    the checkpoint to resume from."""
    run_dir = Path(cfg.run_dir)
    previous = _read_json(run_dir / JOB_FILE) or {}
    resume_from, recorded_id = (None, None)
    if job.get("multirun") and cfg.get("ckpt_path") is None:
        resume_from, recorded_id = _resumable_checkpoint(cfg)
        if resume_from is not None:
            cfg.ckpt_path = resume_from
    run_id = recorded_id or previous.get("wandb_run_id") or _new_run_id()
    for node in _wandb_loggers(cfg):
        node.group = node.get("group") or cfg.get("study")
        node.job_type = node.get("job_type") or job["layout"]["name"]
        if not node.get("name") and job.get("multirun"):
            node.name = f"{cfg.get('study')}/{job['num']}"
        node.id = node.get("id") or run_id
        node.resume = node.get("resume") or "allow"
        run_id = node.id
    job.update(wandb_run_id=run_id if _wandb_loggers(cfg) else None, resumed_from=resume_from)
    job["attempt"] = int(previous.get("attempt", -1)) + 1
    cfg.job = job
    if global_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run_dir / JOB_FILE, {**previous, **job})


def _finished(run_dir: Path, fingerprint: str) -> dict[str, Any] | None:
    results = _read_json(run_dir / RESULTS_FILE)
    if results and results.get("status") == "completed":
        if results.get("config_fingerprint") != fingerprint:
            raise ValueError(
                f"{run_dir} holds a finished job of another config (fingerprint {results.get('config_fingerprint')}, "
                f"this one {fingerprint}). Give this sweep its own directory with study=<a new name>."
            )
        return results
    return None


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
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run_dir / RESULTS_FILE, doc)
    return doc


def _say(message: str) -> None:
    if global_rank() == 0:
        print(f"[sweep] {message}", flush=True)


def _torchrun(cfg: DictConfig, config_file: Path, log: Path) -> int:
    from lightning_scale.cli.train import RESOLVED_CONFIG_ENV, _device_count

    trainer = cfg.trainer
    nproc = _device_count(trainer.get("devices", 1), str(trainer.get("accelerator", "cpu")))
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env[RESOLVED_CONFIG_ENV] = str(config_file)
    env[ORPHAN_WATCH_ENV] = "1"  # torchrun puts each rank in a session of its own: see watch_parent
    if str(trainer.get("accelerator", "cpu")) == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "-m", "lightning_scale.cli.train",
    ]  # fmt: skip
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        return subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, check=False).returncode


def watch_parent(interval_s: float = 0.5) -> None:
    """Exit this rank if its torchrun agent dies. torchrun starts every rank in a session of its
    own, so killing a sweep (its process group, or SIGKILL to the agent) would leave the job's
    ranks training on, and writing checkpoints, beside the re-run that resumes the job."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                print(f"[sweep] rank {global_rank()}: the job's launcher (pid {parent}) is gone; exiting", file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="lightning-scale-orphan-watch", daemon=True).start()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_job(cfg: DictConfig, resolved: DictConfig, job: dict[str, Any]) -> dict[str, Any]:
    """One job of a multirun; never raises (a failure is recorded and the sweep goes on)."""
    from lightning_scale.cli.train import run

    run_dir = Path(resolved.run_dir)
    label = f"job {job['num']}"
    start = time.monotonic()
    from lightning_scale.cli.train import LayoutNotAdmitted, preflight

    job["fingerprint"] = config_fingerprint(cast(dict, OmegaConf.to_container(resolved)))
    try:
        try:  # a layout these processes, this machine or the model cannot take: skipped, with the reason
            job["layout"] = layout_of(resolved, job.get("strategy_choice"))
            label = f"job {job['num']} ({job['layout']['name']})"
            _check_fits(resolved)
        except ValueError as err:
            raise LayoutNotAdmitted(str(err)) from None
        preflight(resolved)  # any other bad input fails the job before a process starts
    except LayoutNotAdmitted as err:
        _say(f"{label}: skipped: {err}")
        return _record(run_dir, job, "skipped", reason=str(err))
    except ValueError as err:
        _say(f"{label}: failed: {err}")
        return _record(run_dir, job, "failed", reason=str(err))
    try:
        done = _finished(run_dir, job["fingerprint"])
        if done is not None:
            _say(f"{label}: finished earlier, skipped ({run_dir / RESULTS_FILE})")
            return done
        prepare_job(resolved, job)
        if launched_externally() or (_own_process() and _world_size(resolved) == 1):
            # srun started every rank of this job, or this process is the job's alone (a submitit
            # job of one device): train here.
            run(resolved)
            code = 0
        else:
            config_file = run_dir / "resolved_config.yaml"
            OmegaConf.save(resolved, config_file)
            code = _torchrun(resolved, config_file, run_dir / _LOG_FILE)
    except Exception as err:  # noqa: BLE001 - a failed job is recorded, the sweep goes on
        _say(f"{label}: failed: {err!r}")
        return _record(run_dir, job, "failed", reason=repr(err), elapsed_s=round(time.monotonic() - start, 1))
    results = _read_json(run_dir / RESULTS_FILE) or {}
    if code != 0 or results.get("status") != "completed" or results.get("config_fingerprint") != job["fingerprint"]:
        reason = f"exit code {code}" + ("" if code else ", no results.json")
        _say(f"{label}: failed ({reason}); log: {run_dir / _LOG_FILE}\n{_tail(run_dir / _LOG_FILE)}")
        return _record(run_dir, job, "failed", reason=reason, elapsed_s=round(time.monotonic() - start, 1))
    rate = results.get("tokens_per_sec")
    _say(f"{label}: completed in {time.monotonic() - start:.0f} s" + (f", {rate:,.0f} tokens/s" if rate else ""))
    return results


def collect_results(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every job's ``results.json`` under ``sweep_dir``, in job order, each with its ``job_dir``."""
    found = []
    for path in sorted(Path(sweep_dir).rglob(RESULTS_FILE)):
        if any(part.startswith(".") for part in path.relative_to(sweep_dir).parts):
            continue
        doc = _read_json(path)
        if doc is not None:
            found.append({**doc, "job_dir": str(path.parent)})
    return sorted(found, key=lambda d: (d.get("job") is None, d.get("job") if isinstance(d.get("job"), int) else 0, d["job_dir"]))


def failed_jobs() -> int:
    """Jobs that failed in the last multirun of this process (``lightning-scale-train``'s exit status)."""
    return _FAILED[-1] if _FAILED else 0


class SweepSummary(Callback):
    """Hydra callback: at the end of a multirun, print one line per job (status, layout, tokens/s
    or the reason), write ``<sweep dir>/sweep.json`` and set the exit status to the failed count."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        job_dirs = [p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")] if sweep_dir.is_dir() else []
        results = {Path(r["job_dir"]).resolve(): r for r in collect_results(sweep_dir)}
        rows = []
        for job_dir in sorted(job_dirs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)):
            doc = results.get(job_dir.resolve())
            if doc is None and not (job_dir / ".hydra").is_dir() and not (job_dir / JOB_FILE).is_file():
                continue  # not a job directory (e.g. the report)
            doc = doc or {"status": "failed", "reason": f"no {RESULTS_FILE} (the job did not finish)"}
            rows.append({"dir": job_dir.name, **{k: doc.get(k) for k in ("status", "layout", "tokens_per_sec", "reason")}})
        counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
        _FAILED.append(counts["failed"])
        _write_json(sweep_dir / "sweep.json", {"study": config.get("study"), "counts": counts, "jobs": rows})
        print(f"[sweep] {sweep_dir}: " + ", ".join(f"{n} {s}" for s, n in counts.items()), flush=True)
        for r in rows:
            detail = f"{r['tokens_per_sec']:,.0f} tokens/s" if r.get("tokens_per_sec") else (r.get("reason") or "")
            print(f"[sweep]   {r['dir']:>4} {r['status']:<9} {r.get('layout') or '':<16} {detail}", flush=True)
        if rows:
            print(f"[sweep] report: lightning-scale-report {sweep_dir}", flush=True)
