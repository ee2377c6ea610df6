"""``PreemptionCheckpoint``: on SIGTERM (cloud spot, Kubernetes) or SIGUSR1 (SLURM's warning signal) every rank
finishes the optimizer step it is in, one checkpoint is committed, and the process exits with
:data:`~lightning_scale.plugins.PREEMPTION_EXIT_CODE`. For a fit under another strategy (Lightning's
``DDPStrategy``): ``HybridParallelStrategy`` handles preemption itself, from its own methods
(:mod:`lightning_scale.strategies.hybrid.resilience`), unless ``ShardedCheckpointIO(preemption=False)``.

The signal handler only sets a flag (:class:`~lightning_scale.core.resilience.preemption.SignalFlag`). After
each optimizer step every rank all-reduces its flag, so all of them stop at the same step even when only one
was signalled. That all-reduce takes the place of Lightning's own: Lightning broadcasts rank 0's SIGTERM flag
before every batch (``_broadcast_sigterm_tensor``, a collective and a host sync), which is idle while this
callback handles SIGTERM, so a fit with preemption runs one such exchange per optimizer step, not two.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_scale._lightning_compat import idle_sigterm_broadcast, restore_sigterm_broadcast
from lightning_scale.core.resilience.preemption import (
    Preempted,
    SignalFlag,
    anyone_signalled,
    check_exit_code,
    check_signals,
)
from lightning_scale.plugins._checkpoint_commit import checkpoint_dir, commit_checkpoint, requeue
from lightning_scale.plugins.checkpoint_io import PREEMPTION_EXIT_CODE, ShardedCheckpointIO
from lightning_scale.strategies.hybrid.strategy import HybridParallelStrategy

__all__ = ["Preempted", "PreemptionCheckpoint", "checkpoint_dir", "commit_checkpoint"]


class PreemptionCheckpoint(Callback):
    """Checkpoint and exit when the job is told it will be stopped.

    ``lightning-scale-train`` adds one under Lightning's strategies (``strategy=ddp``). Under
    ``HybridParallelStrategy``, which handles the same signals itself, it is refused unless
    ``ShardedCheckpointIO(preemption=False)`` turns the strategy's handling off (to use this one's options).

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
        self.signals = check_signals(signals)
        self.exit_code = check_exit_code(exit_code)
        self.dirpath = dirpath
        self.requeue = requeue
        self._flag = SignalFlag(self.signals, owner="PreemptionCheckpoint")
        self._last_step = -1
        self._idled_loop: Any = None

    @property
    def received(self) -> int | None:
        """The signal received during this fit, if any."""
        return self._flag.received

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        io = strategy.checkpoint_io
        if isinstance(strategy, HybridParallelStrategy) and isinstance(io, ShardedCheckpointIO) and io.preemption:
            raise ValueError(
                "PreemptionCheckpoint is in the Trainer's callbacks, but HybridParallelStrategy handles SIGTERM and "
                "SIGUSR1 itself (a checkpoint, then exit 143): two handlers would race for the signals. Remove the "
                "callback, or pass ShardedCheckpointIO(preemption=False) to the strategy to use the callback's "
                "signals, dirpath and exit_code instead."
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After Lightning registered its own SIGTERM handler (which broadcasts inside the handler).
        self._last_step = trainer.global_step
        self._flag.install()
        # While this handler owns SIGTERM, Lightning's flag cannot be set, and its per-batch broadcast of it
        # would be a second collective and host sync per step: idle it for this fit.
        loop = trainer.fit_loop.epoch_loop
        if "SIGTERM" in self.signals and self._flag.installed and idle_sigterm_broadcast(loop):
            self._idled_loop = loop

    def _restore(self) -> None:
        self._flag.restore()
        loop, self._idled_loop = self._idled_loop, None
        if loop is not None:
            restore_sigterm_broadcast(loop)  # the class's own method again

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # a gradient-accumulation micro-step: act after the optimizer step only
        self._last_step = trainer.global_step
        if not anyone_signalled(self._flag.received is not None, trainer.strategy.root_device):
            return
        rank_zero_info(f"Preemption signal received: saving a checkpoint at step {trainer.global_step}, then exiting.")
        path = commit_checkpoint(trainer, self.dirpath)
        rank_zero_info(f"Preemption checkpoint committed: {path}.")
        if self.requeue:
            requeue(trainer)
        raise Preempted(self.exit_code)
