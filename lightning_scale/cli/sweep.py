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

Jobs are matched to directories by their configuration, never by position (``hydra.sweep.subdir``
is ``${ls_job_dir:${hydra.job.num}}``): a job goes to the directory whose records carry its config's
fingerprint, else to ``<job number>/`` when that holds no other job, else to the next free number. So
re-running a study with its sweep values in another order finds every finished job where it is.

``sweep.dry_run=true`` lists every job with what the sweep would do (start, resume, skip, fail,
refuse) and launches nothing; while a job runs, its status (step, loss, tokens/s, ETA, log path) is
printed every ``sweep.progress_every_s`` seconds.

A job's processes die with the sweep, on any signal including SIGKILL: the torchrun agent and every
rank ask the kernel for SIGKILL when their parent dies (``PR_SET_PDEATHSIG``), and a reaper that
outlives the sweep SIGKILLs every other process carrying the job's id in its environment (wandb's
helpers) once the sweep's pipe to it closes. While a job runs, the
sweep holds ``<job dir>/.lock`` (``flock``): a second sweep refuses that job, naming the pid.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import string
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
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
    "describe_totals",
    "study_totals",
    "JobDirBusy",
    "check_sweep_options",
    "config_fingerprint",
    "die_with_parent",
    "failed_jobs",
    "hold_job_dir",
    "job_dir_for",
    "layout_of",
    "run_job",
    "study_name",
]

RESULTS_FILE = "results.json"
JOB_FILE = "job.json"
STATUSES = ("completed", "skipped", "failed")
_LOG_FILE = "job.log"
ORPHAN_WATCH_ENV = "LIGHTNING_SCALE_WATCH_PARENT"
_LOCK_FILE = ".lock"
_CLAIM_FILE = ".ls-job"  # {"config_fingerprint": ...}: written when a job claims its directory
_FAILED: list[int] = []  # failed jobs of the last multirun in this process (the exit status)
# Jobs of this process's multirun that ended without a record of their own (refused: another process holds
# the directory, or it holds another config's finished job): the summary lists them, nothing is written.
_UNRECORDED: list[dict[str, Any]] = []
_DRY_RUN: list[dict[str, Any]] = []  # what a dry run would do, one row per job
_RUN_DIR_PLACEHOLDER = "/__lightning_scale_run_dir__"
_VOLATILE = ("run_dir", "ckpt_path", "job", "sweep")  # differ between attempts of one job (sweep: how to run it)


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
    from lightning_scale.core.parallel.layout import resolve_layout

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


def _task_fingerprint(root: DictConfig) -> str:
    """:func:`config_fingerprint` of the job whose Hydra config is ``root``, before its directory is
    known (its ``run_dir`` is a placeholder that the fingerprint writes as ``${run_dir}`` anyway)."""
    task = OmegaConf.masked_copy(root, [k for k in root if k != "hydra"])
    OmegaConf.set_struct(task, False)
    task.run_dir = _RUN_DIR_PLACEHOLDER
    return config_fingerprint(cast(dict, OmegaConf.to_container(task, resolve=True)))


def _recorded_fingerprint(job_dir: Path) -> str | None:
    """The config fingerprint a job directory's records carry (claim, results or job record), or None."""
    for name, key in ((_CLAIM_FILE, "config_fingerprint"), (RESULTS_FILE, "config_fingerprint"), (JOB_FILE, "fingerprint")):
        doc = _read_json(job_dir / name)
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
        return str(num)  # (and _record never overwrites another config's finished job)
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


def _release_job_dir(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the only descriptor releases the flock


_PR_SET_PDEATHSIG = 1


def _prctl() -> Any:
    """libc's ``prctl``, loaded before any fork (loading a library in a forked child of a threaded
    process can deadlock), or None where there is none."""
    global _PRCTL
    if _PRCTL is None:
        import ctypes
        import ctypes.util

        try:
            _PRCTL = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
        except (OSError, AttributeError):
            _PRCTL = False
    return _PRCTL or None


_PRCTL: Any = None


def die_with_parent(parent: int | None = None, prctl: Any = None) -> bool:
    """Ask the kernel to SIGKILL this process when the thread that started it exits (Linux
    ``prctl(PR_SET_PDEATHSIG)``; SIGKILL of the parent included). If the parent is already gone (it is
    no longer ``parent``), exit now. Returns False where the call is not available."""
    prctl = prctl or _prctl()
    if prctl is None or prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os._exit(1)  # the parent died before the request: nothing would signal us
    return True


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
    from lightning_scale.core.checkpoint.format import latest

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


class ConfigMismatch(ValueError):
    """The job's directory holds a finished job of another config."""


def _finished(run_dir: Path, fingerprint: str) -> dict[str, Any] | None:
    results = _read_json(run_dir / RESULTS_FILE)
    if results and results.get("status") == "completed":
        if results.get("config_fingerprint") != fingerprint:
            raise ConfigMismatch(
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
        existing = _read_json(run_dir / RESULTS_FILE) or {}
        if existing.get("status") == "completed" and existing.get("config_fingerprint") != doc["config_fingerprint"]:
            _UNRECORDED.append({**doc, "job_dir": str(run_dir)})  # never overwrite another config's finished job
            return doc
        if all(existing.get(k) == doc.get(k) for k in ("config_fingerprint", "status", "reason")) and status == "skipped":
            return existing  # the same verdict on the same config: the record stands as written
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run_dir / RESULTS_FILE, doc)
    return doc


def _say(message: str) -> None:
    if global_rank() == 0:
        print(f"[sweep] {message}", flush=True)


def _torchrun(cfg: DictConfig, config_file: Path, log: Path, label: str = "job") -> int:
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
    sweep_pid = os.getpid()
    job_id = f"{sweep_pid}-{time.monotonic_ns()}"
    env[JOB_ID_ENV] = job_id  # every process of the job inherits it: what the reaper looks for
    reaper = _start_reaper(job_id)
    try:
        return _run_agent(cfg, command, env, log, label, sweep_pid)
    finally:
        _stop_reaper(reaper)


JOB_ID_ENV = "LIGHTNING_SCALE_SWEEP_JOB"
# The reaper: a tiny process (no imports beyond the standard library) that outlives the sweep. It blocks
# on a pipe from the sweep; at end of file (the job ended, or the sweep died, however) it SIGKILLs every
# process whose environment carries the job's id: what PR_SET_PDEATHSIG cannot reach, such as the helpers
# that wandb's service starts, which no sweep process is the parent of.
_REAPER = """
import os, signal, sys, time
mark = ("%s=" + sys.argv[1]).encode()
sys.stdin.buffer.read()
for _ in range(10):
    found = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\\0"):
                    os.kill(int(pid), signal.SIGKILL)
                    found += 1
        except OSError:
            pass
    if not found:
        break
    time.sleep(0.1)
""" % JOB_ID_ENV


def _start_reaper(job_id: str) -> subprocess.Popen[bytes] | None:
    if not Path("/proc").is_dir():
        return None
    env = {k: v for k, v in os.environ.items() if k != JOB_ID_ENV}
    return subprocess.Popen([sys.executable, "-S", "-c", _REAPER, job_id], stdin=subprocess.PIPE, env=env, start_new_session=True)


def _stop_reaper(reaper: subprocess.Popen[bytes] | None) -> None:
    if reaper is not None and reaper.stdin is not None:
        reaper.stdin.close()  # end of file: it ends what is left of the job, then exits
        try:
            reaper.wait(timeout=10)
        except subprocess.TimeoutExpired:
            reaper.kill()


def _run_agent(cfg: DictConfig, command: list[str], env: dict[str, str], log: Path, label: str, sweep_pid: int) -> int:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        # The agent dies with this process (SIGKILL included); its ranks die with the agent (watch_parent).
        prctl = _prctl()  # loaded here: the child only calls it
        proc = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=lambda: die_with_parent(sweep_pid, prctl)
        )
        progress = _Progress(log, label, int(cfg.trainer.get("max_steps", -1)))
        try:
            while True:
                try:
                    return proc.wait(timeout=float(OmegaConf.select(cfg, "sweep.progress_every_s", default=_PROGRESS_EVERY_S)))
                except subprocess.TimeoutExpired:
                    progress.report()
        except BaseException:
            proc.kill()  # KeyboardInterrupt and the like: the job's processes go with the sweep
            proc.wait()
            raise


_PROGRESS_EVERY_S = 10.0
_STEP_LINE = re.compile(r"^step (\d+)(?:/(\d+))?(.*)$")


class _Progress:
    """One status line per running job from its log's newest ``ConsoleLogger`` line: step, loss,
    tokens/s and the time left at the rate so far."""

    def __init__(self, log: Path, label: str, max_steps: int) -> None:
        self.log, self.label, self.max_steps = log, label, max_steps
        self.start = time.monotonic()
        self.first: tuple[float, int] | None = None
        self.last_step: int | None = None

    def report(self) -> None:
        line = next((ln for ln in reversed(_tail(self.log, 200).splitlines()) if _STEP_LINE.match(ln)), None)
        if line is None:
            return
        match = _STEP_LINE.match(line)
        assert match is not None
        step = int(match.group(1))
        if step == self.last_step:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = (now, step)
        self.last_step = step
        fields = dict(part.strip().split(" ", 1) for part in match.group(3).split("|") if " " in part.strip())
        parts = [f"step {step}" + (f"/{self.max_steps}" if self.max_steps > 0 else "")]
        if "train/loss" in fields:
            parts.append(f"loss {float(fields['train/loss']):.4f}")
        if "train/tokens_per_sec" in fields:
            parts.append(f"{float(fields['train/tokens_per_sec']):,.0f} tokens/s")
        t0, s0 = self.first
        if self.max_steps > 0 and step > s0:
            parts.append(f"ETA {(self.max_steps - step) * (now - t0) / (step - s0):.0f} s")
        _say(f"{self.label}: " + ", ".join(parts) + f" ({self.log})")


def watch_parent(interval_s: float = 0.5) -> None:
    """Exit this rank when its torchrun agent dies. torchrun starts every rank in a session of its
    own, so killing a sweep (its process group, or SIGKILL to the agent) would leave the job's ranks
    training on, and writing checkpoints, beside the re-run that resumes the job. The kernel kills the
    rank with its parent (``PR_SET_PDEATHSIG``; torchrun starts ranks from its main thread); where
    that is not available, a thread polls the parent every ``interval_s``."""
    import threading

    parent = os.getppid()
    try:
        launcher = Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        launcher = b""
    if b"torch.distributed.run" not in launcher and b"torchrun" not in launcher:
        print(f"[sweep] rank {global_rank()}: the job's launcher is gone (parent {parent}); exiting", file=sys.stderr, flush=True)
        os._exit(1)
    if die_with_parent(parent):
        return

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
    from lightning_scale.cli.train import LayoutNotAdmitted, preflight, run

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
            _check_fits(resolved)
        except ValueError as err:
            raise LayoutNotAdmitted(str(err)) from None
        preflight(resolved)  # any other bad input fails the job before a process starts
    except LayoutNotAdmitted as err:
        if dry_run:
            return _plan(run_dir, job, "skip", str(err))
        _say(f"{label}: skipped: {err}")
        return _record(run_dir, job, "skipped", reason=str(err))
    except ValueError as err:
        if dry_run:
            return _plan(run_dir, job, "fail", str(err))
        _say(f"{label}: failed: {err}")
        return _record(run_dir, job, "failed", reason=str(err))
    if dry_run:
        return _dry_run(resolved, run_dir, job)
    lock = None
    try:
        lock = hold_job_dir(run_dir)
        done = _finished(run_dir, job["fingerprint"])
        if done is not None:
            _say(f"{label}: finished earlier, skipped ({run_dir / RESULTS_FILE})")
            return done
        prepare_job(resolved, job)
        load_start = os.getloadavg()[0]  # before this job's processes: what else the machine was doing
        if launched_externally() or (_own_process() and _world_size(resolved) == 1):
            # srun started every rank of this job, or this process is the job's alone (a submitit
            # job of one device): train here.
            _say(f"{label}: started in {run_dir}")
            run(resolved)
            code = 0
        else:
            config_file = run_dir / "resolved_config.yaml"
            OmegaConf.save(resolved, config_file)
            _say(f"{label}: started; log: {run_dir / _LOG_FILE}")
            code = _torchrun(resolved, config_file, run_dir / _LOG_FILE, label)
    except (JobDirBusy, ConfigMismatch) as err:  # the directory is not this job's to write: nothing is written
        _say(f"{label}: refused: {err}")
        doc = {"status": "failed", "job": job.get("num"), "layout": job.get("layout", {}).get("name"), "reason": str(err),
               "overrides": job.get("overrides"), "job_dir": str(run_dir)}  # fmt: skip
        _UNRECORDED.append(doc)
        return doc
    except Exception as err:  # noqa: BLE001 - a failed job is recorded, the sweep goes on
        _say(f"{label}: failed: {err!r}")
        return _record(run_dir, job, "failed", reason=repr(err), elapsed_s=round(time.monotonic() - start, 1))
    finally:
        _release_job_dir(lock)
    results = _read_json(run_dir / RESULTS_FILE) or {}
    if code != 0 or results.get("status") != "completed" or results.get("config_fingerprint") != job["fingerprint"]:
        reason = f"exit code {code}" + ("" if code else ", no results.json")
        _say(f"{label}: failed ({reason}); log: {run_dir / _LOG_FILE}\n{_tail(run_dir / _LOG_FILE)}")
        return _record(run_dir, job, "failed", reason=reason, elapsed_s=round(time.monotonic() - start, 1))
    # The report warns when a job started on a busy machine: its throughput is noise.
    results["load_average"] = {"start": load_start, "end": os.getloadavg()[0]}
    results["cpu_count"] = os.cpu_count()
    _write_json(run_dir / RESULTS_FILE, results)
    rate = results.get("tokens_per_sec")
    _say(f"{label}: completed in {time.monotonic() - start:.0f} s" + (f", {rate:,.0f} tokens/s" if rate else ""))
    return results


def _plan(run_dir: Path, job: dict[str, Any], action: str, reason: str) -> dict[str, Any]:
    """A dry run's line for one job: what the sweep would do, and why."""
    row = {"job": job.get("num"), "dir": str(run_dir), "action": action, "layout": (job.get("layout") or {}).get("name"),
           "overrides": job.get("overrides"), "reason": reason}  # fmt: skip
    _DRY_RUN.append(row)
    _say(f"dry run: job {job.get('num')} ({row['layout'] or '?'}): {action}: {reason}")
    _forget_unused_dir(run_dir)
    return row


def _dry_run(resolved: DictConfig, run_dir: Path, job: dict[str, Any]) -> dict[str, Any]:
    """What a real run would do with an admitted job: skip it (finished), resume it, or start it."""
    results = _read_json(run_dir / RESULTS_FILE) or {}
    if results.get("status") == "completed":
        if results.get("config_fingerprint") != job["fingerprint"]:
            return _plan(run_dir, job, "refuse", f"{run_dir} holds a finished job of another config")
        return _plan(run_dir, job, "skip", f"finished earlier ({run_dir / RESULTS_FILE})")
    try:
        _release_job_dir(hold_job_dir(run_dir)) if run_dir.is_dir() else None
    except JobDirBusy as err:
        return _plan(run_dir, job, "refuse", str(err))
    checkpoint, _ = _resumable_checkpoint(resolved)
    world = _world_size(resolved)
    if checkpoint is not None:
        return _plan(run_dir, job, "resume", f"from {checkpoint} on {world} process(es)")
    return _plan(run_dir, job, "start", f"{world} process(es), {resolved.trainer.get('max_steps')} steps")


def _forget_unused_dir(run_dir: Path) -> None:
    """A dry run leaves no job directory behind that Hydra created for it (only ``.hydra`` and an
    empty log inside); a directory holding any record of a job stays."""
    if not run_dir.is_dir():
        return
    names = {p.name for p in run_dir.iterdir()}
    if names <= {".hydra", "train.log"} and (not (run_dir / "train.log").exists() or (run_dir / "train.log").stat().st_size == 0):
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)


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


def study_totals(jobs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What a study cost, over its jobs that ran (completed, or failed after running): ``device_hours``
    (each job's elapsed time x its devices), ``job_hours`` (the jobs' elapsed times added: the wall time
    of a sweep that runs them one after another), ``usd`` (the jobs' recorded cost, ``None`` when no job
    recorded one) and ``priced_jobs`` of ``jobs_run``."""
    ran = [j for j in jobs if isinstance(j.get("elapsed_s"), (int, float))]
    priced = [j for j in ran if isinstance(j.get("usd"), (int, float))]
    return {
        "jobs_run": len(ran),
        "device_hours": sum(float(j["elapsed_s"]) * int(j.get("world_size") or 1) for j in ran) / 3600,
        "job_hours": sum(float(j["elapsed_s"]) for j in ran) / 3600,
        "usd": sum(float(j["usd"]) for j in priced) if priced else None,
        "priced_jobs": len(priced),
    }


def describe_totals(totals: Mapping[str, Any]) -> str:
    """One line for a study's totals (:func:`study_totals`)."""
    usd = (f"${totals['usd']:,.2f} ({totals['priced_jobs']} of {totals['jobs_run']} jobs priced)"
           if totals["usd"] is not None else "no cost recorded (no price for the device)")  # fmt: skip
    return (f"{totals['jobs_run']} jobs ran: {totals['device_hours']:.3g} device-hours, "
            f"{totals['job_hours']:.3g} h of jobs, {usd}")  # fmt: skip


def failed_jobs() -> int:
    """Jobs that failed in the last multirun of this process (``lightning-scale-train``'s exit status)."""
    return _FAILED[-1] if _FAILED else 0


def check_sweep_options(cfg: DictConfig) -> None:
    """``ValueError``/``TypeError`` for a bad ``sweep.*`` option, before any job starts."""
    options = cfg.get("sweep") or {}
    dry_run = options.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise TypeError(f"sweep.dry_run={dry_run!r} is not a boolean. Pass sweep.dry_run=true or sweep.dry_run=false.")
    every = options.get("progress_every_s", _PROGRESS_EVERY_S)
    if isinstance(every, bool) or not isinstance(every, (int, float)) or not every > 0:
        raise ValueError(
            f"sweep.progress_every_s={every!r} must be a number of seconds > 0 (how often a running job's status "
            f"is printed). Pass e.g. sweep.progress_every_s={_PROGRESS_EVERY_S:g}."
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
            print(f"[sweep] dry run of {sweep_dir}: {len(_DRY_RUN)} jobs (" + ", ".join(f"{n} {a}" for a, n in counts.items())
                  + "); nothing was launched", flush=True)  # fmt: skip
            for row in _DRY_RUN:
                print(f"[sweep]   {Path(row['dir']).name:>4} {row['action']:<8} {row['layout'] or '':<16} {row['reason']}", flush=True)
            if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= {"multirun.yaml"}:
                import shutil

                shutil.rmtree(sweep_dir, ignore_errors=True)  # a new study: the dry run leaves nothing behind
            return
        job_dirs = [p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")] if sweep_dir.is_dir() else []
        results = {Path(r["job_dir"]).resolve(): r for r in collect_results(sweep_dir)}
        refused = {Path(r["job_dir"]).resolve(): r for r in _UNRECORDED}
        rows = []
        for job_dir in sorted(job_dirs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)):
            doc = refused.get(job_dir.resolve()) or results.get(job_dir.resolve())
            if doc is None and not (job_dir / ".hydra").is_dir() and not (job_dir / JOB_FILE).is_file():
                continue  # not a job directory (e.g. the report)
            doc = doc or {"status": "failed", "reason": f"no {RESULTS_FILE} (the job did not finish)"}
            rows.append({"dir": job_dir.name, **{k: doc.get(k) for k in ("status", "layout", "tokens_per_sec", "reason")}})
        counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
        _FAILED.append(counts["failed"])
        totals = study_totals(list(results.values()))
        _write_json(sweep_dir / "sweep.json", {"study": config.get("study"), "counts": counts, "totals": totals, "jobs": rows})
        print(f"[sweep] {sweep_dir}: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f"; {describe_totals(totals)}",
              flush=True)  # fmt: skip
        for r in rows:
            detail = f"{r['tokens_per_sec']:,.0f} tokens/s" if r.get("tokens_per_sec") else (r.get("reason") or "")
            print(f"[sweep]   {r['dir']:>4} {r['status']:<9} {r.get('layout') or '':<16} {detail}", flush=True)
        if rows:
            print(f"[sweep] report: lightning-scale-report {sweep_dir}", flush=True)
