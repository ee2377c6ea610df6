"""``lightning-scale-train``: compose the Hydra config, check it, and train.

Lightning's subprocess launcher starts each extra rank by re-running ``sys.argv``. Left alone,
every child would compose the config again (``${now:}`` resolves per process, hydra #2070) and,
inside ``--multirun``, re-run the whole sweep (Lightning #11300, #18175). So the launching process
resolves the config once, writes it to ``<run_dir>/resolved_config.yaml`` and names it in
``LIGHTNING_SCALE_RESOLVED_CONFIG``; a child (``LOCAL_RANK`` set) that finds that variable loads
the file and never enters Hydra. All processes share the one absolute ``run_dir``.

When torchrun or SLURM starts every rank, each composes the config; ``environment.py`` gives them one
run directory, and only global rank 0 writes the resolved config and the summary.

The entry point only: it dispatches to ``sweep.py`` (a multirun's jobs) or ``run.py`` (one run), and may
import every other module of ``cli``'s chain (see ``cli/__init__.py``).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from lightning_scale.callbacks import Preempted
from lightning_scale.cli.environment import (
    ORPHAN_WATCH_ENV,
    RESOLVED_CONFIG_ENV,
    global_rank,
    launched_externally,
    watch_parent,
)
from lightning_scale.cli.job_config import job_info, layout_of
from lightning_scale.cli.resolvers import register_resolvers
from lightning_scale.cli.run import prepare_job, run, threads_left
from lightning_scale.cli.sweep import failed_jobs, run_job
from lightning_scale.core.deprecation import moved_names
from lightning_scale.core.telemetry.peaks import PEAK_FILE_ENV

__all__ = ["main"]

# 0.1.0 exported these from here; they went down the chain (issue 25).
__getattr__ = moved_names(
    __name__,
    {
        "LayoutNotAdmitted": "lightning_scale.cli.job_config.LayoutNotAdmitted",
        "build": "lightning_scale.cli.run.build",
        "planned_data_parallel_size": "lightning_scale.cli.job_config.planned_data_parallel_size",
        "preflight": "lightning_scale.cli.job_config.preflight",
    },
)


def _log_to_run_files() -> None:
    """Lightning's messages and the console's lines into the run's log files too (Hydra's job logging
    gave the root logger a file handler, ``train.log``): Lightning's loggers keep their own console
    handler and do not propagate, and the console lines are printed."""
    import logging

    from lightning_scale.callbacks.console import CONSOLE_LOG

    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for logger in (logging.getLogger("lightning.pytorch"), logging.getLogger("lightning.fabric"), CONSOLE_LOG):
        for handler in files:
            if handler not in logger.handlers:
                logger.addHandler(handler)
        if logger is CONSOLE_LOG and files:
            logger.setLevel(logging.INFO)


def _hydra_entry() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    @hydra.main(version_base="1.3", config_path="pkg://lightning_scale.conf", config_name="config")
    def _main(cfg: DictConfig) -> Any:
        run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
        cfg.run_dir = str(run_dir)
        resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        job = job_info(resolved)
        if job["multirun"]:
            # One measured CPU peak per machine for the whole study: its jobs' MFU share a denominator.
            os.environ.setdefault(PEAK_FILE_ENV, str(Path(HydraConfig.get().sweep.dir).resolve() / "peaks.json"))
            return run_job(cfg, resolved, job)  # its own processes, never in this one
        run_dir.mkdir(parents=True, exist_ok=True)
        _log_to_run_files()
        job["layout"] = layout_of(resolved, job["strategy_choice"])
        prepare_job(resolved, job)
        if global_rank() == 0:
            path = run_dir / "resolved_config.yaml"
            OmegaConf.save(resolved, path)
            if not launched_externally():
                os.environ[RESOLVED_CONFIG_ENV] = str(path)  # for the children Lightning starts
        run(resolved)
        return None

    if launched_externally() and global_rank() != 0:
        # Rank 0 writes the run's .hydra record; the others would write the same files at once.
        sys.argv.append("hydra.output_subdir=null")
    _main()


def main() -> int:
    """Console entry point; the exit status is the number of failed jobs of a multirun (0 otherwise).

    Should a process group's worker threads still run when the job is done, the process ends here
    (exit handlers run, streams flushed) without finalising the interpreter, where such a thread
    would abort it."""
    try:
        status = _main()
    except SystemExit as exc:
        if not threads_left():
            raise
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        if not threads_left():
            raise
        traceback.print_exc()
        status = 1
    if threads_left():
        python_threads = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
        print(
            f"lightning-scale-train: {len(threads_left())} process-group thread(s) still ran at exit "
            f"({', '.join(sorted(set(threads_left())))}; Python threads alive: {python_threads or 'none'}); "
            "ending without interpreter finalisation",
            file=sys.stderr,
            flush=True,
        )
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _main() -> int:
    # Lightning 2.6's pytree helper trips torch>=2.10's LeafSpec deprecation on every batch transfer.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    register_resolvers()
    resolved = os.environ.get(RESOLVED_CONFIG_ENV)
    if resolved and "LOCAL_RANK" in os.environ:
        # A rank started by Lightning's launcher, or by torchrun for one job of a multirun: the
        # config was resolved once already.
        if os.environ.get(ORPHAN_WATCH_ENV):
            watch_parent()
        try:
            run(cast(DictConfig, OmegaConf.load(resolved)))
        except Preempted:
            if launched_externally():
                raise  # torchrun and SLURM read every rank's status: PREEMPTION_EXIT_CODE
            # A child of Lightning's launcher: only that launcher's watcher thread in rank 0 reads this
            # status, and it SIGKILLs rank 0 on any non-zero one, before rank 0 could exit with the
            # job's status (PREEMPTION_EXIT_CODE, once it has waited for this process). The
            # checkpoint is committed: this rank's part ended as it should.
            return 0
        return 0

    _hydra_entry()
    return min(failed_jobs(), 255)


# Resolvers at import: a job unpickled in another process (the submitit launchers) resolves its config
# without running main().
register_resolvers()

if __name__ == "__main__":
    sys.exit(main())
