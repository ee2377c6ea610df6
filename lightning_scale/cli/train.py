"""``lightning-scale-train``: compose the Hydra config, check it, and train.

Lightning's subprocess launcher starts each extra rank by re-running ``sys.argv``. Left alone,
every child would compose the config again (``${now:}`` resolves per process, hydra #2070) and,
inside ``--multirun``, re-run the whole sweep (Lightning #11300, #18175). So the launching process
resolves the config once, writes it to ``<run_dir>/resolved_config.yaml`` and names it in
``LIGHTNING_SCALE_RESOLVED_CONFIG``; a child (``LOCAL_RANK`` set) that finds that variable loads
the file and never enters Hydra. All processes share the one absolute ``run_dir``.

When torchrun or SLURM starts every rank, each composes the config; ``launch.py`` gives them one
run directory, and only global rank 0 writes the resolved config and the summary.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, cast

from lightning.pytorch import LightningModule, Trainer, seed_everything
from omegaconf import DictConfig, OmegaConf

from lightning_scale.callbacks import ConsoleLogger, Preempted, PreemptionCheckpoint
from lightning_scale.cli.launch import global_rank, launched_externally, register_resolvers
from lightning_scale.cli.results import (
    CsvHistory,
    SUMMARY_METRICS,
    ValidationRecord,
    finish_wandb,
    job_results,
    log_config,
    num_parameters,
    peak_memory,
)
from lightning_scale.cli.resume import check_checkpoint_path, resume_checkpoint
from lightning_scale.models import GPTConfig
from lightning_scale.core.telemetry.peaks import PEAK_FILE_ENV
from lightning_scale.core.parallel.process_groups import end_process_groups
from lightning_scale.strategies import HybridParallelStrategy

__all__ = ["RESOLVED_CONFIG_ENV", "LayoutNotAdmitted", "build", "main", "planned_data_parallel_size", "preflight", "run"]

RESOLVED_CONFIG_ENV = "LIGHTNING_SCALE_RESOLVED_CONFIG"
SUMMARY_FILE = "summary.json"
RESULTS_FILE = "results.json"


def _device_count(devices: Any, accelerator: str) -> int:
    """Processes per node that Lightning will start for ``trainer.devices``."""
    if OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str):
        text = devices.strip()
        if "," in text:
            return len([d for d in text.split(",") if d.strip()])
        devices = int(text) if text.lstrip("-").isdigit() else text
    if devices in (-1, "auto"):
        if accelerator in ("gpu", "cuda", "auto"):
            import torch

            return max(torch.cuda.device_count(), 1)
        return 1
    if isinstance(devices, int) and devices > 0:
        return devices
    raise ValueError(f"trainer.devices={devices!r} is not a positive count, a list of device ids, -1 or 'auto'")


def planned_data_parallel_size(cfg: DictConfig) -> int:
    """Data-parallel ranks the run will have, from the config alone (before any process starts)."""
    from lightning_scale.core.parallel.layout import resolve_layout

    trainer = cfg.trainer
    devices = _device_count(trainer.get("devices", 1), str(trainer.get("accelerator", "cpu")))
    world = devices * int(trainer.get("num_nodes", 1))
    strategy = cfg.get("strategy") or {}
    if not any(k in strategy for k in ("data_parallel", "tensor_parallel", "pipeline_parallel")):
        return world
    return resolve_layout(
        world,
        data_parallel=strategy.get("data_parallel", "auto"),
        tensor_parallel=strategy.get("tensor_parallel", 1),
        pipeline_parallel=strategy.get("pipeline_parallel", 1),
        devices_per_node=devices,
    ).dp


def _instantiate(node: Any, *args: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` that lets a constructor's ``ValueError``/``TypeError`` through.

    Hydra wraps every constructor error in ``InstantiationException``; our checks' messages name
    the value and the fix, so surface them as they are. Lists and dicts reach the constructors as
    plain ``list``/``dict`` (``_convert_="all"``), never OmegaConf containers: whatever a module keeps
    (``save_hyperparameters``) goes into checkpoints, which must load with ``weights_only=True``.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    kwargs.setdefault("_convert_", "all")
    try:
        return instantiate(node, *args, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, (ValueError, TypeError)):
            raise err.__cause__ from None
        raise


def preflight(cfg: DictConfig) -> tuple[Any, Any]:
    """Check everything checkable from the config alone; returns (model config, datamodule).

    Raises ``ValueError`` for bad input before any process group or child process exists.
    """
    check_checkpoint_path(cfg)
    model_config = _instantiate(cfg.model)
    datamodule = _instantiate(cfg.data)
    if datamodule.seq_len > model_config.block_size:
        raise ValueError(
            f"data.seq_len={datamodule.seq_len} exceeds the model's context model.block_size="
            f"{model_config.block_size}. Set data.seq_len<={model_config.block_size} or raise model.block_size."
        )
    dp_size = planned_data_parallel_size(cfg)
    datamodule.check_data_parallel(dp_size)
    if datamodule.vocab_size > model_config.vocab_size:
        raise ValueError(
            f"The data has token ids up to {datamodule.vocab_size - 1} but model.vocab_size="
            f"{model_config.vocab_size}. Set model.vocab_size>={datamodule.vocab_size}."
        )
    strategy = cfg.get("strategy") or {}
    if str(strategy.get("_target_", "")).endswith("HybridParallelStrategy") and isinstance(model_config, GPTConfig):
        _check_gpt_layout(model_config, strategy)
    return model_config, datamodule


class LayoutNotAdmitted(ValueError):
    """The model cannot be cut this way (a sweep skips such a job rather than failing it)."""


def _check_gpt_layout(config: GPTConfig, strategy: Any) -> None:
    """The reference GPT's limits on the layout: whole heads per tensor-parallel rank, a block per stage."""
    from lightning_scale.core.checks import divisors

    tp, pp = strategy.get("tensor_parallel", 1), strategy.get("pipeline_parallel", 1)
    if isinstance(tp, int) and tp > 1:
        kv = config.n_kv_heads or config.n_heads
        if config.n_heads % tp or kv % tp:
            raise LayoutNotAdmitted(
                f"tensor_parallel={tp} does not divide the model's n_heads={config.n_heads} (n_kv_heads={kv}): each "
                f"tensor-parallel rank needs whole heads. Use tensor_parallel in {divisors(kv)}."
            )
    if isinstance(pp, int) and pp > 1:
        from lightning_scale.core.pipeline.partition import stages_per_rank

        stages = pp * stages_per_rank(str(strategy.get("schedule", "1f1b")), int(strategy.get("virtual_stages", 2)))
        if stages > config.n_layers:
            raise LayoutNotAdmitted(
                f"pipeline_parallel={pp} needs {stages} pipeline stages but the model has n_layers={config.n_layers} "
                f"blocks. Use pipeline_parallel<={config.n_layers} or a deeper model."
            )


def build(cfg: DictConfig) -> tuple[LightningModule, Any, Trainer, ValidationRecord]:
    """Instantiate (module, datamodule, trainer) after checking everything checkable up front
    (:func:`preflight`)."""
    model_config, datamodule = preflight(cfg)
    seed_everything(int(cfg.seed), workers=True, verbose=False)
    module = _instantiate(cfg.module, model_config)
    record = ValidationRecord()
    callbacks = [_instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    loggers = [_instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None]
    from lightning.pytorch.loggers import CSVLogger

    callbacks += [CsvHistory(lg) for lg in loggers if isinstance(lg, CSVLogger)]  # a resumed run keeps its rows
    strategy = _instantiate(cfg.strategy)
    if not isinstance(strategy, HybridParallelStrategy) and not any(isinstance(c, PreemptionCheckpoint) for c in callbacks):
        # HybridParallelStrategy adds one to every fit; Lightning's strategies do not, and their own SIGTERM
        # handling ends the run with status 0 and no checkpoint, so a scheduler would take it as finished.
        callbacks.append(PreemptionCheckpoint())
    trainer = _instantiate(
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
    plugin = _instantiate(node)
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(strategy, DeepSpeedStrategy):
        return {"precision": plugin.precision}
    return {"plugins": [plugin]}


_CHILD_EXIT_TIMEOUT_S = 60.0
_threads_left: list[str] = []  # process-group threads that outlived the run's end (see _end_processes)


def _end_processes(launcher: Any, *, finished: bool) -> None:
    """Leave nothing running when a run ends, however it ends.

    The process groups are destroyed and the meshes' references to them released, which joins their
    worker threads while the interpreter is alive (see :mod:`lightning_scale.core.parallel.process_groups`:
    left to the interpreter's exit, a gloo worker aborted the process, status 134, after a run that
    succeeded). Should any still run, :func:`main` ends the process without finalising the
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
            print(f"lightning-scale-train: rank process {child.pid} did not exit; killing it", file=sys.stderr, flush=True)
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
    resume_step = _checkpoint_step(ckpt_path) if ckpt_path is not None else None
    if cfg.validate_before_fit:
        # With a checkpoint, "before" means the weights training resumes from: logged (and recorded) at the
        # step it resumes from, so the curves and the loggers' steps go on from there rather than from 0.
        if resume_step is not None:
            record.resume_step = resume_step
            trainer.fit_loop.epoch_loop._batches_that_stepped = resume_step  # the step Lightning logs evaluation at
        metrics = trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False)
        record.resume_step = None
        trainer.fit_loop.epoch_loop._batches_that_stepped = 0  # the fit restores it from the checkpoint
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
    peaks = peak_memory(trainer)  # a collective: every rank
    finish_wandb(trainer)
    if trainer.is_global_zero:
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run_dir) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        ConsoleLogger.emit("summary: " + json.dumps(summary))
        results = job_results(cfg, summary, record, trainer, datamodule, peaks)
        (Path(cfg.run_dir) / RESULTS_FILE).write_text(json.dumps(results, indent=2, default=str))
    return summary


def _checkpoint_step(path: str) -> int | None:
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


def _job_info(cfg: DictConfig) -> dict[str, Any]:
    """This run's place in its study: job number, its own overrides, the group choices."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    choices = hydra_cfg.runtime.choices
    return {
        "study": cfg.get("study"),
        "num": hydra_cfg.job.get("num") if hydra_cfg.mode == RunMode.MULTIRUN else None,
        "multirun": hydra_cfg.mode == RunMode.MULTIRUN,
        "overrides": [o for o in hydra_cfg.overrides.task if not o.startswith(("hydra.", "hydra/"))],
        "strategy_choice": choices.get("strategy"),
        "precision_choice": choices.get("precision"),
        "experiment": choices.get("experiment"),
    }


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

    from lightning_scale.cli import sweep

    @hydra.main(version_base="1.3", config_path="pkg://lightning_scale.conf", config_name="config")
    def _main(cfg: DictConfig) -> Any:
        run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
        cfg.run_dir = str(run_dir)
        resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        job = _job_info(resolved)
        if job["multirun"]:
            # One measured CPU peak per machine for the whole study: its jobs' MFU share a denominator.
            os.environ.setdefault(PEAK_FILE_ENV, str(Path(HydraConfig.get().sweep.dir).resolve() / "peaks.json"))
            return sweep.run_job(cfg, resolved, job)  # its own processes, never in this one
        run_dir.mkdir(parents=True, exist_ok=True)
        _log_to_run_files()
        job["layout"] = sweep.layout_of(resolved, job["strategy_choice"])
        sweep.prepare_job(resolved, job)
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
        if not _threads_left:
            raise
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        if not _threads_left:
            raise
        traceback.print_exc()
        status = 1
    if _threads_left:
        print(
            f"lightning-scale-train: {len(_threads_left)} process-group thread(s) still ran at exit "
            f"({', '.join(sorted(set(_threads_left)))}); ending without interpreter finalisation",
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
    from lightning_scale.cli import sweep

    if resolved and "LOCAL_RANK" in os.environ:
        # A rank started by Lightning's launcher, or by torchrun for one job of a multirun: the
        # config was resolved once already.
        if os.environ.get(sweep.ORPHAN_WATCH_ENV):
            sweep.watch_parent()
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
    return min(sweep.failed_jobs(), 255)


# Resolvers at import: a job unpickled in another process (the submitit launchers) resolves its config
# without running main().
register_resolvers()

if __name__ == "__main__":
    sys.exit(main())
