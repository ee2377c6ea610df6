"""Every private Lightning API lightning-scale uses, each behind one named shim.

The Lightning counterpart of :mod:`lightning_scale.core.compat` (which holds torch's, and :class:`Shim`):
private attributes of the ``Trainer`` and its connectors and loops, private hooks of ``Strategy``,
``Precision`` and ``LightningModule``, private functions, and the methods patched at run time. Each
shim's docstring names the API, why it is needed and the public alternative, if any. All were written
against :data:`WRITTEN_AGAINST`; ``tests/test_compat.py`` holds one canary per entry of :data:`SHIMS`,
and they justify the upper bound on ``lightning`` in ``pyproject.toml``.

Private names are imported when a shim is called: an upgrade that drops one breaks only what uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch.trainer.states import RunningStage

from lightning_scale.core.compat import Shim, private_api

__all__ = [
    "CHECKPOINT_IO_FIELD",
    "LIGHTNING_VERSION",
    "PRECISION_PLUGIN_FIELD",
    "SHIMS",
    "WRITTEN_AGAINST",
    "after_closure",
    "attached_trainer",
    "batches_that_stepped",
    "before_batch_transfer",
    "checkpoint_connector",
    "cluster_environment",
    "idle_sigterm_broadcast",
    "init_dist_connection",
    "load_module_state",
    "log_metrics",
    "loop_data_source",
    "migrate_checkpoint",
    "restore_sigterm_broadcast",
    "restore_training_state",
    "set_device_mesh",
    "set_initial_hparam",
    "should_accumulate",
    "should_update_logs",
    "skips_backward",
    "use_subprocess_launcher",
    "wandb_run_started",
    "wrap_resume_start",
    "wrap_update_learning_rates",
]

LIGHTNING_VERSION = "2.6.6"
"""The Lightning release every shim here was written and checked against."""
WRITTEN_AGAINST = f"lightning {LIGHTNING_VERSION}"


def _private(module: str, name: str, shim: str) -> Any:
    return private_api(module, name, shim=f"{__name__}.{shim}", written_against=WRITTEN_AGAINST)


# ---------------------------------------------------------------- the Trainer's checkpoint connector


def checkpoint_connector(trainer: Any) -> Any:
    """The ``Trainer``'s private ``_checkpoint_connector``: what resumes a fit and restores a checkpoint's
    state into the model, precision plugin and optimizers. No public alternative."""
    return trainer._checkpoint_connector


_RESUME_RESOLVER = "_lightning_scale_resolves_ckpt_path"


def wrap_resume_start(trainer: Any, resolve: Callable[[Any], Any]) -> None:
    """Make the checkpoint connector's ``resume_start(checkpoint_path, weights_only)`` resume from
    ``resolve(checkpoint_path)`` (once per ``Trainer``; later calls do nothing). A run-time patch of
    ``_CheckpointConnector.resume_start``: Lightning passes ``ckpt_path`` to it only, so that is where
    ``"latest"`` (and ``None`` after a restart) become a path. Public alternative: none (``Strategy`` sees
    the path only once it is resolved)."""
    connector = checkpoint_connector(trainer)
    if getattr(connector, _RESUME_RESOLVER, False):
        return
    original = connector.resume_start

    def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        return original(resolve(checkpoint_path), weights_only=weights_only)

    connector.resume_start = resume_start
    setattr(connector, _RESUME_RESOLVER, True)


def restore_training_state(trainer: Any, checkpoint: Mapping[str, Any]) -> None:
    """Restore ``checkpoint`` (a loaded Lightning checkpoint) into the model, the precision plugin and the
    optimizers and LR schedulers, as a resumed fit does, but not the loops: counters and data go on.

    The connector's private ``_loaded_checkpoint`` and its ``restore_model``,
    ``restore_precision_plugin_state`` and ``restore_optimizers_and_schedulers``. Public alternative:
    ``trainer.fit(ckpt_path=...)``, which restores the loops too.
    """
    connector = checkpoint_connector(trainer)
    connector._loaded_checkpoint = checkpoint
    try:
        connector.restore_model()
        connector.restore_precision_plugin_state()
        connector.restore_optimizers_and_schedulers()
    finally:
        connector._loaded_checkpoint = {}


# ---------------------------------------------------------------- the Trainer's logger connector


def should_update_logs(trainer: Any, missing: bool | None = None) -> bool:
    """Whether this step is one the loggers write at (``Trainer(log_every_n_steps=...)``): the private
    ``_logger_connector.should_update_logs``, which Lightning's own ``LearningRateMonitor`` reads too (in a
    training batch its answer, without its loop and enum look-ups: ``tests/test_compat.py`` compares the two).
    ``missing``: the answer for a trainer without one (Fabric's stand-in); None: raise. No public alternative."""
    if missing is None:
        if trainer.state.stage is RunningStage.TRAINING and (every := trainer.log_every_n_steps):
            return (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % every == 0 or bool(trainer.should_stop)
        return bool(trainer._logger_connector.should_update_logs)
    return bool(getattr(getattr(trainer, "_logger_connector", None), "should_update_logs", missing))


def log_metrics(trainer: Any, metrics: dict[str, Any], step: int) -> None:
    """Write ``metrics`` to every logger at ``step`` the way ``self.log`` does (the private
    ``_logger_connector.log_metrics``: the epoch added, tensors made numbers, loggers saved). Public
    alternative: ``logger.log_metrics`` for each of ``trainer.loggers``, without those."""
    trainer._logger_connector.log_metrics(metrics, step=step)


# ---------------------------------------------------------------- the fit loops


def should_accumulate(trainer: Any) -> bool:
    """Whether the current batch is a gradient-accumulation micro-step (no optimizer step after it): the
    training epoch loop's private ``_should_accumulate()`` (without accumulation never: every batch reaches
    ``accumulate_grad_batches=1``, so that method returns False without a call). No public alternative."""
    return trainer.accumulate_grad_batches != 1 and bool(trainer.fit_loop.epoch_loop._should_accumulate())


def batches_that_stepped(trainer: Any, count: int | None = None) -> int:
    """The step Lightning logs at, first set to ``count`` if given (the training epoch loop's private
    ``_batches_that_stepped``; a fit restores it from its checkpoint). No public alternative (``global_step``
    is read-only, stays 0 in ``trainer.validate`` and counts optimizer steps under manual optimisation)."""
    loop = trainer.fit_loop.epoch_loop
    if count is not None:
        loop._batches_that_stepped = count
    return loop._batches_that_stepped


_LR_GUARD = "_lightning_scale_lr_guard"


def wrap_update_learning_rates(trainer: Any, skip: Callable[[str], bool]) -> None:
    """Make the training epoch loop's ``_update_learning_rates(interval, update_plateau_schedulers)`` do
    nothing while ``skip(interval)`` is true (once per loop; later calls do nothing).

    A run-time patch of the private ``_TrainingEpochLoop._update_learning_rates``: Lightning steps the LR
    schedulers after every optimizer step it asked for, even one the precision plugin skipped
    (Lightning #5558). No public alternative.
    """
    loop = trainer.fit_loop.epoch_loop
    if loop.__dict__.get(_LR_GUARD):
        return
    update = loop._update_learning_rates

    def guarded(interval: str, update_plateau_schedulers: bool) -> None:
        if skip(interval):
            return
        update(interval=interval, update_plateau_schedulers=update_plateau_schedulers)

    loop._update_learning_rates = guarded
    loop.__dict__[_LR_GUARD] = True


_SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"


def _no_broadcast() -> None:
    """Lightning's per-batch SIGTERM broadcast, idle: the handler that owns SIGTERM agrees on the signal."""


def idle_sigterm_broadcast(loop: Any) -> bool:
    """Make the training epoch loop's per-batch broadcast of Lightning's SIGTERM flag do nothing (until
    :func:`restore_sigterm_broadcast`); False if this Lightning has none. A run-time patch of the private
    ``_TrainingEpochLoop._broadcast_sigterm_tensor`` (a collective and a host sync before every batch), for
    when another handler owns SIGTERM and the flag cannot be set. No public alternative."""
    if not callable(getattr(type(loop), _SIGTERM_BROADCAST, None)):
        return False
    setattr(loop, _SIGTERM_BROADCAST, _no_broadcast)
    return True


def restore_sigterm_broadcast(loop: Any) -> None:
    """Undo :func:`idle_sigterm_broadcast`: the class's own method again."""
    if _SIGTERM_BROADCAST in vars(loop):
        delattr(loop, _SIGTERM_BROADCAST)


def skips_backward(trainer: Any) -> bool:
    """Whether the fit loop runs this step forward only (``StochasticWeightAveraging``'s extra epoch): the
    private ``_FitLoop._skip_backward``. No public alternative."""
    return bool(trainer.fit_loop._skip_backward)


def loop_data_source(loop: Any) -> Any:
    """The loop's source of dataloaders (``is_defined()``, ``dataloader()``), or None: the private
    ``_data_source`` of the fit, evaluation and prediction loops. Public alternative:
    ``trainer.train_dataloader`` and the like, which exist only once the loop has set them up."""
    return getattr(loop, "_data_source", None)


def cluster_environment(trainer: Any) -> Any:
    """The cluster environment Lightning chose for this run (SLURM, torchelastic, ...), also for strategies
    without one of their own: the private ``_accelerator_connector.cluster_environment``. Public alternative:
    ``trainer.strategy.cluster_environment``, for parallel strategies only."""
    return trainer._accelerator_connector.cluster_environment


# ---------------------------------------------------------------- LightningModule


def attached_trainer(module: Any) -> Any:
    """The ``Trainer`` ``module`` is attached to, or None: the private ``LightningModule._trainer``. Public
    alternative: ``module.trainer``, which raises when there is none."""
    return module._trainer


def set_device_mesh(module: Any, mesh: Any) -> None:
    """Give ``module`` the device mesh ``module.device_mesh`` returns (``configure_model`` reads it): the
    private ``LightningModule._device_mesh``, which Lightning's ``ModelParallelStrategy`` sets the same way.
    No public alternative (``device_mesh`` is read-only)."""
    module._device_mesh = mesh


def before_batch_transfer(module: Any, batch: Any, dataloader_idx: int = 0) -> Any:
    """``batch`` through the ``on_before_batch_transfer`` hook of the datamodule or the module, as the loops
    call it: the private ``LightningModule._on_before_batch_transfer``. Public alternative:
    ``module.on_before_batch_transfer``, which misses a datamodule's hook."""
    return module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)


def set_initial_hparam(module: Any, key: str, value: Any) -> None:
    """Set ``key`` in what loggers record as the module's hyperparameters (``hparams_initial``, a copy of the
    private ``_hparams_initial`` that ``save_hyperparameters`` fills). Public alternative:
    ``save_hyperparameters`` with the value among the ``__init__`` arguments."""
    module._hparams_initial[key] = value


# ---------------------------------------------------------------- Strategy and Precision


def use_subprocess_launcher(strategy: Any, before_launch: Callable[[Any], None] | None = None) -> None:
    """Launch the strategy's processes as Lightning's DDP does (re-running the script per local rank): the
    private ``_SubprocessScriptLauncher`` stored in the private ``Strategy._launcher``, from an override of
    the private hook ``Strategy._configure_launcher``. ``before_launch(trainer)`` runs in the launching
    process before any child starts (the trainer's module is set by then). No public alternative
    (Lightning's launchers and the hook are private)."""
    launcher = _private(
        "lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher", "use_subprocess_launcher"
    )
    if before_launch is not None:
        import weakref

        # Held weakly: a bound method of the strategy would keep the strategy, its mesh and so its process
        # groups alive for as long as the launcher is (a run keeps its launcher to wait for its children).
        check = weakref.WeakMethod(before_launch) if hasattr(before_launch, "__self__") else lambda: before_launch

        class _CheckedLauncher(launcher):  # type: ignore[misc, valid-type]
            def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
                found = check()
                if found is not None:
                    found(trainer)
                return super().launch(function, *args, trainer=trainer, **kwargs)

        launcher = _CheckedLauncher
    strategy._launcher = launcher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)


PRECISION_PLUGIN_FIELD = "_precision_plugin"
"""Where a ``Strategy`` keeps the precision plugin it was given (None: none given), which Lightning's
accelerator connector reads directly: a strategy that overrides the ``precision_plugin`` property must keep
it there. Private ``Strategy._precision_plugin``; no public alternative."""
CHECKPOINT_IO_FIELD = "_checkpoint_io"
"""Where a ``Strategy`` keeps the checkpoint IO it was given (None: none given), which Lightning's
accelerator connector reads directly: see :data:`PRECISION_PLUGIN_FIELD`. Private ``Strategy._checkpoint_io``."""


def after_closure(plugin: Any, model: Any, optimizer: Any) -> None:
    """What a precision plugin runs between the closure and the optimizer step: the
    ``on_before_optimizer_step`` hooks of callbacks and module, then gradient clipping. Private
    ``Precision._after_closure``; public alternative: none (its parts call Lightning's private hook runners)."""
    plugin._after_closure(model, optimizer)


def init_dist_connection(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """Create the default process group from the cluster environment (and set ``MASTER_ADDR`` and friends
    the way Lightning's strategies do): private ``lightning.fabric.utilities.distributed._init_dist_connection``.
    Public alternative: ``torch.distributed.init_process_group``, without the environment variables."""
    _private("lightning.fabric.utilities.distributed", "_init_dist_connection", "init_dist_connection")(
        cluster_environment, backend, **kwargs
    )


# ---------------------------------------------------------------- checkpoints and loggers


def migrate_checkpoint(checkpoint: dict[str, Any], checkpoint_path: Any = None) -> dict[str, Any]:
    """``checkpoint`` upgraded to this Lightning's format, as ``load_from_checkpoint`` does: private
    ``lightning.pytorch.utilities.migration.utils._pl_migrate_checkpoint``. Public alternative: the
    ``python -m lightning.pytorch.utilities.upgrade_checkpoint`` command, for files."""
    migrate = _private("lightning.pytorch.utilities.migration.utils", "_pl_migrate_checkpoint", "migrate_checkpoint")
    return migrate(checkpoint, checkpoint_path=checkpoint_path)


def load_module_state(cls: type, checkpoint: dict[str, Any], *, strict: bool | None, **kwargs: Any) -> Any:
    """``cls`` built from a loaded checkpoint dict (hyperparameters, then weights), as ``load_from_checkpoint``
    does with a file: private ``lightning.pytorch.core.saving._load_state``. Public alternative:
    ``cls.load_from_checkpoint(path)``, from a file only."""
    load = _private("lightning.pytorch.core.saving", "_load_state", "load_module_state")
    return load(cls, checkpoint, strict=strict, **kwargs)


def wandb_run_started(logger: Any) -> bool:
    """Whether a ``WandbLogger`` has started (or adopted) its wandb run: its private ``_experiment``.
    Public alternative: none (``logger.experiment`` starts one; ``logger.version`` is the run id either way)."""
    return logger._experiment is not None


def _shim(targets: tuple[str, ...], shims: tuple[str, ...]) -> Shim:
    return Shim(targets, shims, WRITTEN_AGAINST)


_LOOPS = "lightning.pytorch.loops"
_CONNECTORS = "lightning.pytorch.trainer.connectors"

SHIMS: dict[str, Shim] = {
    "checkpoint_connector": _shim(("lightning.pytorch.Trainer()._checkpoint_connector",), ("checkpoint_connector",)),
    "resume_start": _shim(
        (f"{_CONNECTORS}.checkpoint_connector._CheckpointConnector.resume_start",), ("wrap_resume_start",)
    ),
    "restore_training_state": _shim(
        tuple(
            f"{_CONNECTORS}.checkpoint_connector._CheckpointConnector{member}"
            for member in (
                "()._loaded_checkpoint",
                ".restore_model",
                ".restore_precision_plugin_state",
                ".restore_optimizers_and_schedulers",
            )
        ),
        ("restore_training_state",),
    ),
    "logger_connector": _shim(
        (
            "lightning.pytorch.Trainer()._logger_connector",
            f"{_CONNECTORS}.logger_connector.logger_connector._LoggerConnector.should_update_logs",
            f"{_CONNECTORS}.logger_connector.logger_connector._LoggerConnector.log_metrics",
        ),
        ("should_update_logs", "log_metrics"),
    ),
    "should_accumulate": _shim(
        (f"{_LOOPS}.training_epoch_loop._TrainingEpochLoop._should_accumulate",), ("should_accumulate",)
    ),
    "batches_that_stepped": _shim(
        (f"{_LOOPS}.training_epoch_loop._TrainingEpochLoop()._batches_that_stepped",),
        ("batches_that_stepped", "should_update_logs"),  # the latter's fast path in a training batch
    ),
    "update_learning_rates": _shim(
        (f"{_LOOPS}.training_epoch_loop._TrainingEpochLoop._update_learning_rates",), ("wrap_update_learning_rates",)
    ),
    "broadcast_sigterm_tensor": _shim(
        (f"{_LOOPS}.training_epoch_loop._TrainingEpochLoop._broadcast_sigterm_tensor",),
        ("idle_sigterm_broadcast", "restore_sigterm_broadcast"),
    ),
    "skip_backward": _shim((f"{_LOOPS}.fit_loop._FitLoop._skip_backward",), ("skips_backward",)),
    "data_source": _shim(
        (
            f"{_LOOPS}.fit_loop._FitLoop()._data_source",
            f"{_LOOPS}.evaluation_loop._EvaluationLoop()._data_source",
            f"{_LOOPS}.prediction_loop._PredictionLoop()._data_source",
        ),
        ("loop_data_source",),
    ),
    "accelerator_connector": _shim(("lightning.pytorch.Trainer()._accelerator_connector",), ("cluster_environment",)),
    "module_trainer": _shim(("lightning.pytorch.LightningModule()._trainer",), ("attached_trainer",)),
    "module_device_mesh": _shim(("lightning.pytorch.LightningModule()._device_mesh",), ("set_device_mesh",)),
    "on_before_batch_transfer": _shim(
        ("lightning.pytorch.LightningModule._on_before_batch_transfer",), ("before_batch_transfer",)
    ),
    "hparams_initial": _shim(
        ("lightning.pytorch.core.mixins.hparams_mixin.HyperparametersMixin()._hparams_initial",),
        ("set_initial_hparam",),
    ),
    "subprocess_launcher": _shim(
        (
            "lightning.pytorch.strategies.launchers._SubprocessScriptLauncher",
            "lightning.pytorch.strategies.Strategy._configure_launcher",
            "lightning.pytorch.strategies.Strategy()._launcher",
        ),
        ("use_subprocess_launcher",),
    ),
    "strategy_precision_plugin_field": _shim(
        ("lightning.pytorch.strategies.Strategy()._precision_plugin",), ("PRECISION_PLUGIN_FIELD",)
    ),
    "strategy_checkpoint_io_field": _shim(
        ("lightning.pytorch.strategies.Strategy()._checkpoint_io",), ("CHECKPOINT_IO_FIELD",)
    ),
    "after_closure": _shim(("lightning.pytorch.plugins.precision.Precision._after_closure",), ("after_closure",)),
    "init_dist_connection": _shim(
        ("lightning.fabric.utilities.distributed._init_dist_connection",), ("init_dist_connection",)
    ),
    "migrate_checkpoint": _shim(
        ("lightning.pytorch.utilities.migration.utils._pl_migrate_checkpoint",), ("migrate_checkpoint",)
    ),
    "load_state": _shim(("lightning.pytorch.core.saving._load_state",), ("load_module_state",)),
    "wandb_experiment": _shim(("lightning.pytorch.loggers.WandbLogger()._experiment",), ("wandb_run_started",)),
}
"""Every private Lightning API the package uses: entry name (its canary's id) -> :class:`Shim`."""
