"""The process and its launcher: which rank this is, who started it, what the ranks share, and how a
rank dies with the process that started it. Imports nothing else from ``cli`` (the bottom of its chain:
environment <- job_config <- results <- run <- sweep <- train; see ``cli/__init__.py``).

One run directory for all ranks when an external launcher starts every process.

With Lightning's own launcher only the first process composes the config (see ``train.py``).
Under ``torchrun`` (single- or multi-node) and SLURM's ``srun`` every rank runs
``lightning-scale-train`` and composes the config itself, so a run directory stamped with each
process's clock (``${now:}``, hydra #2070) would split one run into several. The config names its
run directory with the ``ls_run_name`` resolver instead:

- torchrun (recognised by its ``TORCHELASTIC_RUN_ID``): one directory per run id, which every
  restart keeps, so a relaunched or resized job (``--max-restarts``, an elastic ``--nnodes=MIN:MAX``)
  finds its checkpoints and records. With torchrun's shared agent store (the default) it is the first
  attempt's rank 0 start time, kept in that store under the run id, e.g. ``2026-11-30/06-31-02``;
  without it (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which an elastic launch needs) nothing outlives
  an attempt, so the name is the run id itself, ``torchrun-<--rdzv-id>`` (and refused when there is no
  ``--rdzv-id``);
- SLURM with several tasks: ``slurm-<job id>`` (``-<step id>`` for a job step);
- otherwise: this process's start time.

Ranks other than 0 log to ``train.rank<N>.log`` (``ls_log_suffix``) and skip Hydra's ``.hydra``
output, so they never write a file rank 0 writes.

A sweep's ranks die with it (:func:`die_with_parent`, :func:`watch_parent`); the sweep names them
the resolved config through ``LIGHTNING_SCALE_RESOLVED_CONFIG`` (:data:`RESOLVED_CONFIG_ENV`).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from functools import cache
from pathlib import Path
from typing import Any

__all__ = [
    "ORPHAN_WATCH_ENV",
    "RESOLVED_CONFIG_ENV",
    "die_with_parent",
    "libc_prctl",
    "log_suffix",
    "global_rank",
    "launched_externally",
    "own_process",
    "run_name",
    "study_name",
    "wandb_offline",
    "watch_parent",
]

RESOLVED_CONFIG_ENV = "LIGHTNING_SCALE_RESOLVED_CONFIG"
"""Names the resolved config file a rank loads instead of composing its own (``train.py``)."""
ORPHAN_WATCH_ENV = "LIGHTNING_SCALE_WATCH_PARENT"
"""Set for a sweep job's ranks: each exits when its torchrun agent dies (:func:`watch_parent`)."""
_STORE_KEY = "lightning_scale/run_name"


def _torchrun() -> bool:
    """torchrun started this process: every torchrun worker has a run id and its master's address
    (Lightning's own launcher sets only the latter)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_ADDR" in os.environ


def _slurm() -> bool:
    return "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def launched_externally() -> bool:
    """True when torchrun or SLURM started this process as one rank of several."""
    return _torchrun() or _slurm()


def global_rank() -> int:
    for name in ("RANK", "SLURM_PROCID"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


@cache
def run_name() -> str:
    """The run's directory name below ``outputs/``, the same on every rank of one launch and at every
    restart of it."""
    if _torchrun():
        return _torchrun_run_name(os.environ["TORCHELASTIC_RUN_ID"])
    if _slurm():
        step = os.environ.get("SLURM_STEP_ID")
        return f"slurm-{os.environ['SLURM_JOB_ID']}" + (f"-{step}" if step not in (None, "0", "batch") else "")
    return time.strftime("%Y-%m-%d/%H-%M-%S")


def _torchrun_run_name(run_id: str) -> str:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The agent's store outlives its workers: the first attempt's rank 0 names the run, restarts read it.
        import torch.distributed as dist

        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(minutes=10),
            wait_for_workers=False,
        )
        key = f"{_STORE_KEY}/{run_id}"
        if global_rank() == 0:  # set only when absent: a restart keeps the first attempt's name
            return store.compare_set(key, "", time.strftime("%Y-%m-%d/%H-%M-%S")).decode()
        return store.get(key).decode()
    if run_id in ("", "none"):
        raise ValueError(
            f"torchrun started this process with TORCHELASTIC_RUN_ID={run_id!r} (no --rdzv-id) and without its shared "
            "agent store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as an elastic launch needs), so its ranks and restarts "
            "have nothing to agree on a run directory through. Pass torchrun --rdzv-id=<a name for this run> (the run "
            "directory is then outputs/torchrun-<name> at every restart), or hydra.run.dir=<a directory>."
        )
    return "torchrun-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)


def log_suffix() -> str:
    """``${ls_log_suffix:}``: ``.rank<N>`` on a rank other than 0 that an external launcher started."""
    rank = global_rank() if launched_externally() else 0
    return f".rank{rank}" if rank else ""


def own_process() -> bool:
    """This process was started for this one job (submitit's local or SLURM executor), not the
    sweeping process that runs every job in turn."""
    return "SUBMITIT_LOCAL_JOB_ID" in os.environ or "SLURM_JOB_ID" in os.environ


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


_PR_SET_PDEATHSIG = 1


def libc_prctl() -> Any:
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
    prctl = prctl or libc_prctl()
    if prctl is None or prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os._exit(1)  # the parent died before the request: nothing would signal us
    return True


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
        print(
            f"[sweep] rank {global_rank()}: the job's launcher is gone (parent {parent}); exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
    if die_with_parent(parent):
        return

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                print(
                    f"[sweep] rank {global_rank()}: the job's launcher (pid {parent}) is gone; exiting",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    threading.Thread(target=watch, name="lightning-scale-orphan-watch", daemon=True).start()
