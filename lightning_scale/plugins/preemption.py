"""Preemption: on SIGTERM (cloud spot, Kubernetes) or SIGUSR1 (SLURM's warning signal) every rank
finishes the optimizer step it is in, one checkpoint is committed, and the process exits with
:data:`~lightning_scale.plugins.PREEMPTION_EXIT_CODE`.

The signal handler only sets a flag (a collective inside a handler can pair with the wrong call on
another rank, which Lightning's own SIGTERM handler risks). After each optimizer step every rank
all-reduces its flag, so all of them stop at the same step even when only one was signalled. That
all-reduce takes the place of Lightning's own: Lightning broadcasts rank 0's SIGTERM flag before every
batch (``_broadcast_sigterm_tensor``, a collective and a host sync), which is idle while this callback
handles SIGTERM, so a fit with preemption runs one such exchange per optimizer step, not two.

A callback that lives among the plugins: ``HybridParallelStrategy`` adds one to every ``fit`` (when its
``ShardedCheckpointIO(preemption=True)``, the default), and strategies never import callbacks. Users
import it from :mod:`lightning_scale.callbacks`.
"""

from __future__ import annotations

import os
import signal
import subprocess
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_scale._lightning_compat import cluster_environment, idle_sigterm_broadcast, restore_sigterm_broadcast
from lightning_scale.core.checkpoint.format import checkpoint_name
from lightning_scale.core.checkpoint.storage import AnyPath, as_path
from lightning_scale.plugins.checkpoint_io import PREEMPTION_EXIT_CODE, ShardedCheckpointIO

__all__ = ["Preempted", "PreemptionCheckpoint", "checkpoint_dir", "commit_checkpoint"]

_SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGUSR1": signal.SIGUSR1, "SIGUSR2": signal.SIGUSR2, "SIGINT": signal.SIGINT}


class Preempted(SystemExit):
    """Raised on every rank after the checkpoint that stops the run is committed (a preemption signal; a
    subclass for another reason, e.g. ``StragglerRestart``); the process exits with ``code``."""


def checkpoint_dir(trainer: Trainer, dirpath: str | os.PathLike | None = None) -> AnyPath:
    """Where a checkpoint taken outside ``ModelCheckpoint``'s schedule goes: ``dirpath``, else the first
    ``ModelCheckpoint``'s directory, else ``ShardedCheckpointIO(dirpath=...)``, else
    ``<default_root_dir>/checkpoints``."""
    io = trainer.strategy.checkpoint_io
    sharded = isinstance(io, ShardedCheckpointIO)
    convert = io.as_path if sharded else as_path
    if dirpath is not None:
        return convert(dirpath)
    for callback in trainer.checkpoint_callbacks:
        if getattr(callback, "dirpath", None):
            return convert(callback.dirpath)
    if sharded and io.dirpath is not None:
        return io.dirpath
    return convert(trainer.default_root_dir) / "checkpoints"


def commit_checkpoint(trainer: Trainer, dirpath: str | os.PathLike | None = None) -> AnyPath:
    """On every rank: save a full checkpoint of this step, ``step-NNNNNN`` in :func:`checkpoint_dir`, through
    the Trainer (sharded, verified and atomic under ``ShardedCheckpointIO``), wait until it is committed (an
    async save included) and meet at a barrier. The run resumes from it (``ckpt_path="latest"``)."""
    name = checkpoint_name(trainer.global_step)
    io = trainer.strategy.checkpoint_io
    if not isinstance(io, ShardedCheckpointIO):
        name += ".ckpt"  # Lightning's own format, one file: named as Lightning names them, so "latest" finds it
    path = checkpoint_dir(trainer, dirpath) / name
    trainer.save_checkpoint(path, weights_only=False)  # a full checkpoint: the run resumes from it
    if isinstance(io, ShardedCheckpointIO):
        io.wait()  # committed before the process goes
    trainer.strategy.barrier("commit_checkpoint")
    return path


class PreemptionCheckpoint(Callback):
    """Checkpoint and exit when the job is told it will be stopped.

    ``HybridParallelStrategy`` adds one to every ``fit`` that has none; ``lightning-scale-train`` adds one
    under Lightning's strategies too (``strategy=ddp``).

    Args:
        signals: the signals that mean "stop soon" (names).
        dirpath: where the checkpoint goes (default: the first ``ModelCheckpoint``'s directory, else
            ``ShardedCheckpointIO(dirpath=...)``, else ``<default_root_dir>/checkpoints``); it is named
            ``step-NNNNNN`` (``step-NNNNNN.ckpt`` in Lightning's own format, e.g. under ``DDPStrategy``),
            so ``ckpt_path="latest"`` and a relaunch find it.
        exit_code: the process's exit status afterwards (default 143, as for a process ended by
            SIGTERM): non-zero, so torchrun ``--max-restarts`` relaunches and the relaunch resumes.
        requeue: under SLURM with Lightning's ``auto_requeue`` (the default), rank 0 requeues the job
            (``scontrol requeue``) before exiting.
    """

    def __init__(
        self,
        signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1"),
        *,
        dirpath: str | os.PathLike | None = None,
        exit_code: int = PREEMPTION_EXIT_CODE,
        requeue: bool = True,
    ) -> None:
        unknown = [s for s in signals if s not in _SIGNALS]
        if unknown or not signals:
            raise ValueError(f"signals={signals!r}: each must be one of {sorted(_SIGNALS)} (at least one).")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 1 <= exit_code <= 255:
            raise ValueError(f"exit_code={exit_code!r} must be an integer from 1 to 255 (0 would end a torchrun job).")
        self.signals = tuple(signals)
        self.dirpath = dirpath
        self.exit_code = exit_code
        self.requeue = requeue
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._last_step = -1
        self._idled_loop: Any = None

    # ------------------------------------------------------------------ handlers

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum  # nothing else here: the step boundary acts on it

    def _install(self) -> None:
        if self._previous:
            return
        for name in self.signals:
            sig = _SIGNALS[name]
            if signal.getsignal(sig) is None:
                # Installed outside Python (faulthandler.register, a native library): Python can neither
                # chain to it nor put it back.
                rank_zero_warn(
                    f"PreemptionCheckpoint: {name} has a handler installed outside Python (e.g. faulthandler.register); "
                    f"it is replaced during fit and {name} has its default action afterwards. Pass "
                    f"PreemptionCheckpoint(signals=...) without {name} to keep it."
                )
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: signals cannot be handled here
                rank_zero_warn(f"PreemptionCheckpoint: cannot handle {name} outside the main thread.")

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        loop = self._idled_loop
        if loop is not None:
            restore_sigterm_broadcast(loop)  # the class's own method again
        self._idled_loop = None

    def _replace_lightning_broadcast(self, trainer: Trainer) -> None:
        """While this callback's handler owns SIGTERM, Lightning's flag cannot be set, and its per-batch
        broadcast of it would be a second collective and host sync per step: idle it for this fit."""
        loop = trainer.fit_loop.epoch_loop
        if signal.SIGTERM in self._previous and idle_sigterm_broadcast(loop):
            self._idled_loop = loop

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After Lightning registered its own SIGTERM handler (which broadcasts inside the handler).
        self.received = None
        self._last_step = trainer.global_step
        self._install()
        self._replace_lightning_broadcast(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore()

    # ------------------------------------------------------------------ the step boundary

    def _anyone_signalled(self, trainer: Trainer) -> bool:
        flag = torch.tensor([0 if self.received is None else 1], device=trainer.strategy.root_device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # a gradient-accumulation micro-step: act after the optimizer step only
        self._last_step = trainer.global_step
        if not self._anyone_signalled(trainer):
            return
        rank_zero_info(f"Preemption signal received: saving a checkpoint at step {trainer.global_step}, then exiting.")
        path = commit_checkpoint(trainer, self.dirpath)
        rank_zero_info(f"Preemption checkpoint committed: {path}.")
        if self.requeue and trainer.is_global_zero:
            self._requeue(trainer)
        raise Preempted(self.exit_code)

    @staticmethod
    def _requeue(trainer: Trainer) -> None:
        environment = cluster_environment(trainer)
        if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
            return
        job = os.environ.get("SLURM_JOB_ID")
        if os.environ.get("SLURM_ARRAY_JOB_ID"):
            job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
        if not job:
            return
        result = subprocess.run(["scontrol", "requeue", job], check=False)
        if result.returncode != 0:
            rank_zero_warn(f"scontrol requeue {job} failed with exit code {result.returncode}.")
