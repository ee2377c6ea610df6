"""One training job in this process: prepare it (its wandb run, the checkpoint it resumes from, its
``job.json``), build the module, datamodule and trainer from the checked config, train, write its
``summary.json`` and ``results.json``, and leave no process or process-group thread behind. May import
from ``cli`` ``environment``, ``job_config``, ``results`` and ``resume`` (see ``cli/__init__.py``)."""

from __future__ import annotations

import json
import logging
import random
import string
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer, seed_everything
from omegaconf import DictConfig

from lightning_scale._lightning_compat import batches_that_stepped
from lightning_scale.callbacks import ConsoleLogger, GoodputMonitor, PreemptionCheckpoint, each_callback
from lightning_scale.callbacks.group import group_callbacks
from lightning_scale.cli.environment import global_rank
from lightning_scale.cli.job_config import instantiate, preflight
from lightning_scale.cli.results import (
    JOB_FILE,
    RESULTS_FILE,
    SUMMARY_FILE,
    SUMMARY_METRICS,
    CsvHistory,
    ValidationRecord,
    finish_wandb,
    job_results,
    log_config,
    num_parameters,
    peak_memory,
    read_json,
    write_json,
)
from lightning_scale.cli.resume import resumable_checkpoint, resume_checkpoint
from lightning_scale.core.parallel.process_groups import end_process_groups
from lightning_scale.strategies import HybridParallelStrategy

__all__ = ["build", "checkpoint_step", "prepare_job", "run", "threads_left"]


def _wandb_loggers(cfg: DictConfig) -> list[Any]:
    loggers = cfg.get("logger") or {}
    return [
        node for node in loggers.values() if node is not None and str(node.get("_target_", "")).endswith("WandbLogger")
    ]


def _new_run_id() -> str:
    return "".join(random.SystemRandom().choices(string.ascii_lowercase + string.digits, k=8))


def prepare_job(cfg: DictConfig, job: dict[str, Any]) -> None:
    """Fill in what each job (or single run) needs before it starts: the wandb run (one per job,
    group = study, job type = layout, the id kept across resumes) and, for a job that ran before,
    the checkpoint to resume from."""
    run_dir = Path(cfg.run_dir)
    previous = read_json(run_dir / JOB_FILE) or {}
    resume_from, recorded_id = (None, None)
    if job.get("multirun") and cfg.get("ckpt_path") is None:
        resume_from, recorded_id = resumable_checkpoint(cfg)
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
        write_json(run_dir / JOB_FILE, {**previous, **job})


class _NoTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def drop_lightning_tips() -> None:
    """Drop Lightning's advertisements ("💡 Tip: ... try installing litlogger", printed by every ``Trainer``
    whose loggers hold no ``LitLogger``) from the console of ``lightning-scale-train``: nothing its user can
    act on. They come through ``rank_zero_info``, on the logger of ``lightning.pytorch.utilities.rank_zero``
    (``tests/test_cli.py`` checks the quickstart's output has none); idempotent."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoTips) for f in logger.filters):
        logger.addFilter(_NoTips())


def build(cfg: DictConfig) -> tuple[LightningModule, Any, Trainer, ValidationRecord]:
    """Instantiate (module, datamodule, trainer) after checking everything checkable up front
    (:func:`preflight`)."""
    model_config, datamodule = preflight(cfg)
    seed_everything(int(cfg.seed), workers=True, verbose=False)
    module = instantiate(cfg.module, model_config)
    record = ValidationRecord()
    # The config's callbacks dispatched as one (but those Lightning finds by type): the same hooks, less per step.
    callbacks = group_callbacks([instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None])
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    from lightning.pytorch.loggers import CSVLogger

    callbacks += [CsvHistory(lg) for lg in loggers if isinstance(lg, CSVLogger)]  # a resumed run keeps its rows
    strategy = instantiate(cfg.strategy)
    if not isinstance(strategy, HybridParallelStrategy) and not any(
        isinstance(c, PreemptionCheckpoint) for c in callbacks
    ):
        # HybridParallelStrategy adds one to every fit; Lightning's strategies do not, and their own SIGTERM
        # handling ends the run with status 0 and no checkpoint, so a scheduler would take it as finished.
        callbacks.append(PreemptionCheckpoint())
    drop_lightning_tips()
    trainer = instantiate(
        cfg.trainer,
        strategy=strategy,
        callbacks=[*callbacks, record],
        logger=loggers or False,
        **_precision(cfg, strategy),
    )
    return module, datamodule, trainer, record


def _precision(cfg: DictConfig, strategy: Any) -> dict[str, Any]:
    """The Trainer's precision argument from the ``precision`` group: our plugin, except under
    DeepSpeed, which only takes its own (its loss scaling is then DeepSpeed's, by the precision name)."""
    node = cfg.get("precision")
    if node is None:
        return {}
    plugin = instantiate(node)
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(strategy, DeepSpeedStrategy):
        return {"precision": plugin.precision}
    return {"plugins": [plugin]}


_CHILD_EXIT_TIMEOUT_S = 60.0
_threads_left: list[str] = []  # process-group threads that outlived the run's end (see _end_processes)


def threads_left() -> list[str]:
    """The process-group threads that outlived the last run's end in this process (none, normally)."""
    return _threads_left


def _end_processes(launcher: Any, *, finished: bool) -> None:
    """Leave nothing running when a run ends, however it ends.

    The process groups are destroyed and the meshes' references to them released, which joins their
    worker threads while the interpreter is alive (see :mod:`lightning_scale.core.parallel.process_groups`:
    left to the interpreter's exit, a gloo worker aborted the process, status 134, after a run that
    succeeded). Should any still run, :func:`lightning_scale.cli.train.main` ends the process without finalising the
    interpreter. On the rank that started the others (Lightning's launcher) every child is waited
    for, so the job's exit status comes last and no rank outlives it."""
    global _threads_left
    _threads_left = end_process_groups(barrier=finished)
    children = getattr(launcher, "procs", None) or []
    deadline = time.monotonic() + _CHILD_EXIT_TIMEOUT_S
    for child in children:
        try:
            child.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            print(
                f"lightning-scale-train: rank process {child.pid} did not exit; killing it", file=sys.stderr, flush=True
            )
            child.kill()
            child.wait()
    failed = {child.pid: child.returncode for child in children if child.returncode}
    if failed and finished:
        raise RuntimeError(f"Rank processes exited with a failure status (pid: status): {failed}; see train.log.")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train as ``cfg`` says; returns (and on global rank 0 writes) the run summary. The process
    groups are destroyed when it returns or raises (:class:`~lightning_scale.callbacks.Preempted` on
    SIGTERM/SIGUSR1, after the checkpoint is committed)."""
    start = time.perf_counter()
    module, datamodule, trainer, record = build(cfg)
    launcher = trainer.strategy.launcher  # its child processes, once fit started them
    finished = False
    try:
        summary = _train(cfg, module, datamodule, trainer, record, start)
        finished = True
    except BaseException as err:
        # Its traceback's frames (fit's, the strategy's, the loop's) hold the model, the strategy and their
        # process groups while it propagates: cleared, the groups end below and join their threads (a
        # preempted or pruned job otherwise waited out the grace and exited unfinalised).
        traceback.clear_frames(err.__traceback__)
        raise
    finally:
        # The groups go with their last references: the model's meshes and the strategy's stages.
        del module, datamodule, trainer, record
        _end_processes(launcher, finished=finished)
    return summary


def _train(
    cfg: DictConfig, module: LightningModule, datamodule: Any, trainer: Trainer, record: ValidationRecord, start: float
) -> dict[str, Any]:
    ckpt_path = resume_checkpoint(cfg)
    if trainer.is_global_zero:
        ConsoleLogger.emit(
            f"lightning-scale-train: {num_parameters(module) / 1e6:.2f}M parameters | {trainer.world_size} process(es) | "
            f"global batch {datamodule.global_batch_size} x {datamodule.seq_len} tokens | run_dir {cfg.run_dir}"
        )
    log_config(trainer, cfg)
    summary: dict[str, Any] = {}
    record.started_at = start
    resume_step = checkpoint_step(ckpt_path) if ckpt_path is not None else None
    if cfg.validate_before_fit:
        # With a checkpoint, "before" means the weights training resumes from: logged (and recorded) at the
        # step it resumes from, so the curves and the loggers' steps go on from there rather than from 0.
        if resume_step is not None:
            record.resume_step = resume_step
            batches_that_stepped(trainer, resume_step)  # the step Lightning logs evaluation at
        metrics = trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False)
        record.resume_step = None
        batches_that_stepped(trainer, 0)  # the fit restores it from the checkpoint
        if resume_step is None:
            record.initial_val_loss = float(metrics[0]["val/loss"])
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    if record.initial_val_loss is not None:  # a resumed fit restored the first attempt's
        summary["initial_val_loss"] = record.initial_val_loss
    # The telemetry's last values now: trainer.validate() below starts a new stage, which empties
    # trainer.callback_metrics (whatever the logger), and the run would record no tokens/s, MFU or $.
    telemetry = {k: float(trainer.callback_metrics[k]) for k in SUMMARY_METRICS if k in trainer.callback_metrics}
    final_train_loss = trainer.callback_metrics.get("train/loss")
    if cfg.validate_after_fit:
        if record.step == trainer.global_step and record.loss is not None:
            summary["final_val_loss"] = record.loss  # the fit already validated the final weights
        else:
            summary["final_val_loss"] = trainer.validate(module, datamodule=datamodule, verbose=False)[0]["val/loss"]
    summary.update(
        global_step=trainer.global_step,
        world_size=trainer.world_size,
        num_parameters=num_parameters(module),
        elapsed_s=round(record.elapsed_s(), 2),  # every attempt's, a resumed run's included
    )
    if final_train_loss is not None:
        summary["final_train_loss"] = float(final_train_loss)
    summary.update(telemetry)  # the telemetry callbacks' last values
    goodput = next((c.summary for c in each_callback(trainer) if isinstance(c, GoodputMonitor) and c.summary), None)
    if goodput is not None:  # global rank 0's: where every attempt's time went (per attempt: run_dir/goodput/)
        summary["goodput"] = {k: v for k, v in goodput.as_dict().items() if k != "per_attempt"}
    peaks = peak_memory(trainer)  # a collective: every rank
    finish_wandb(trainer)
    if trainer.is_global_zero:
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run_dir) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        ConsoleLogger.emit("summary: " + json.dumps(summary))
        results = job_results(cfg, summary, record, trainer, datamodule, peaks)
        (Path(cfg.run_dir) / RESULTS_FILE).write_text(json.dumps(results, indent=2, default=str))
    return summary


def checkpoint_step(path: str) -> int | None:
    """The global step a checkpoint was taken at (its manifest, or a ``.ckpt`` file's ``global_step``)."""
    target = Path(path)
    if target.is_dir():
        try:
            step = json.loads((target / "manifest.json").read_text()).get("global_step")
        except (OSError, ValueError):
            return None
        return step if isinstance(step, int) else None
    if target.is_file():
        import torch

        try:
            state = torch.load(target, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - a file Lightning itself will reject with its own message
            return None
        step = state.get("global_step") if isinstance(state, dict) else None
        return step if isinstance(step, int) else None
    return None
