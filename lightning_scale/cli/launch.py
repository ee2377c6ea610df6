"""One run directory for all ranks when an external launcher starts every process.

With Lightning's own launcher only the first process composes the config (see ``train.py``).
Under ``torchrun`` (single- or multi-node) and SLURM's ``srun`` every rank runs
``lightning-scale-train`` and composes the config itself, so a run directory stamped with each
process's clock (``${now:}``, hydra #2070) would split one run into several. The config names its
run directory with the ``ls_run_name`` resolver instead:

- torchrun: rank 0's start time, shared through the torchrun agent's store
  (``TORCHELASTIC_USE_AGENT_STORE``), e.g. ``2026-11-30/06-31-02``;
- SLURM with several tasks: ``slurm-<job id>`` (``-<step id>`` for a job step);
- otherwise: this process's start time.

Ranks other than 0 log to ``train.rank<N>.log`` (``ls_log_suffix``) and skip Hydra's ``.hydra``
output, so they never write a file rank 0 writes.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from functools import cache

from omegaconf import OmegaConf

__all__ = ["global_rank", "launched_externally", "register_resolvers", "run_name"]

_STORE_KEY = "lightning_scale/run_name"


def _torchrun() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in os.environ


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
    """The run's directory name below ``outputs/``, the same on every rank of one launch."""
    if _torchrun():
        import torch.distributed as dist

        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(minutes=10),
            wait_for_workers=False,
        )
        key = f"{_STORE_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        if global_rank() == 0:
            store.set(key, time.strftime("%Y-%m-%d/%H-%M-%S"))
        return store.get(key).decode()
    if _slurm():
        step = os.environ.get("SLURM_STEP_ID")
        return f"slurm-{os.environ['SLURM_JOB_ID']}" + (f"-{step}" if step not in (None, "0", "batch") else "")
    return time.strftime("%Y-%m-%d/%H-%M-%S")


def _log_suffix() -> str:
    rank = global_rank() if launched_externally() else 0
    return f".rank{rank}" if rank else ""


def _multiply(*values: float) -> float:
    product: float = 1
    for value in values:
        product *= value
    return product


def register_resolvers() -> None:
    """Register the config's resolvers (idempotent): ``${ls_run_name:}``, ``${ls_log_suffix:}``,
    ``${ls_study:}`` (``sweep.study_name``), ``${ls_wandb_offline:}``, ``${ls_mul:a,b}`` and
    ``${ls_job_dir:num}`` (``sweep.job_dir_for``)."""
    from lightning_scale.cli import sweep

    resolvers = {
        "ls_run_name": (run_name, False),
        "ls_log_suffix": (_log_suffix, False),
        "ls_study": (sweep.study_name, True),  # cached: every job of a sweep gets the sweep's name
        "ls_wandb_offline": (sweep.wandb_offline, False),
        "ls_mul": (_multiply, False),
        "ls_job_dir": (sweep.job_dir_for, False),  # a sweep job's directory, chosen by its config
    }
    for name, (function, cached) in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, function, use_cache=cached)
