"""``HangWatchdog``: a training step that runs far longer than the recent ones is a hang; every rank then
writes its stacks to ``<run_dir>/hang/``, one summary names the ranks that never reached the collective
the others wait in, and every process exits with :data:`HANG_EXIT_CODE`, so torchrun ``--max-restarts``
or a requeued job relaunches it and the relaunch resumes from ``"latest"``.

The mechanism is :class:`lightning_scale.core.resilience.watchdog.StepWatchdog`; here, the Lightning
hooks that beat its heart. A callback that lives among the plugins, as the preemption checkpoint does:
``HybridParallelStrategy`` adds one to every ``fit`` (its ``hang_timeout`` option), and strategies never
import callbacks. Users import it from :mod:`lightning_scale.callbacks` too, to watch a fit under another
strategy (``DDPStrategy``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_scale._lightning_hooks import STEP_HOOKS, restore_hooks, skip_hooks
from lightning_scale.core.compat_c10d import default_store
from lightning_scale.core.resilience.watchdog import HANG_EXIT_CODE, StepWatchdog, hang_timeout_policy

__all__ = ["HANG_EXIT_CODE", "HangWatchdog"]


class HangWatchdog(Callback):
    """Detect a stalled training step on any rank, dump every rank's stacks, exit with :data:`HANG_EXIT_CODE`.

    Each rank's training loop sets a heartbeat at the batch's start, before the backward, before the
    optimizer step and at the batch's end (no collective, no host sync); a thread of the rank compares the
    running step with its limit. The limit, by default, is the larger of 120 s and 10x the median of the
    last 20 steps, and at least 600 s for the first 3 steps of a fit (compilation, warm-up). Validation,
    checkpoint saves and the time between steps are not timed (the process group's own timeout applies).

    Under ``HybridParallelStrategy`` the strategy's own per-step methods beat the heart instead
    (:mod:`lightning_scale.strategies.hybrid.heartbeat`) and this callback's per-step hooks are taken out of
    Lightning's dispatch, which cost more than the beats: a step then runs from its batch's start to the next
    batch's (the wait for that batch's data included), with checkpoint saves, validation and the ends of epochs
    still untimed.

    Args:
        hang_timeout: ``"auto"`` (the default just described), a number of seconds (that limit for every
            step), a mapping of :class:`~lightning_scale.core.resilience.watchdog.HangTimeout`'s fields
            (``{"floor_s": 30, "multiple": 5}``), or ``0``/``False``: off.
        dirpath: where the ``hang/`` directory goes (default: the Trainer's ``default_root_dir``, which
            ``lightning-scale-train`` sets to the run directory).
        grace_s: how long the ranks wait for each other's reports before the summary is written.

    Writes ``hang/rank<k>.txt`` on every rank (its heartbeat, every thread's Python stack, the flight
    recorder's trace under NCCL or with ``TORCH_FR_BUFFER_SIZE`` set), ``hang/summary.txt`` once, and one
    JSON line per hang in ``hang/events.jsonl``.
    """

    def __init__(
        self, hang_timeout: Any = "auto", *, dirpath: str | os.PathLike | None = None, grace_s: float = 20.0
    ) -> None:
        self.policy = hang_timeout_policy(hang_timeout)
        self.dirpath = dirpath
        self.grace_s = grace_s
        self.watchdog: StepWatchdog | None = None
        self._detach: Callable[[], None] | None = None

    @classmethod
    def add_to(cls, trainer: Trainer, hang_timeout: Any) -> None:
        """Add one to ``trainer``'s callbacks unless it has one or ``hang_timeout`` turns it off. First in the
        list, so that its batch end stops the clock before the checkpoint callbacks save."""
        if hang_timeout_policy(hang_timeout) is not None and not any(isinstance(c, cls) for c in trainer.callbacks):
            trainer.callbacks.insert(0, cls(hang_timeout))

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()
        if self.policy is None:
            return
        grouped = dist.is_available() and dist.is_initialized()
        self.watchdog = StepWatchdog(
            self.policy,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            directory=Path(self.dirpath if self.dirpath is not None else trainer.default_root_dir) / "hang",
            store=default_store() if grouped and trainer.world_size > 1 else None,
            backend=dist.get_backend() if grouped else None,
            grace_s=self.grace_s,
            global_step=lambda: trainer.global_step,
        )
        self.watchdog.start()
        attach = getattr(trainer.strategy, "attach_heartbeat", None)
        if callable(attach):  # the strategy beats the heart in its own per-step methods: no hook of this one runs
            attach(self.watchdog)
            skip_hooks(self, STEP_HOOKS)
            self._detach = lambda: attach(None)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.watchdog is not None:
            self.watchdog.step_started(trainer.global_step)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        if self.watchdog is not None:
            self.watchdog.entered("backward")

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.watchdog is not None:
            self.watchdog.entered("optimizer step")

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.watchdog is not None:
            self.watchdog.step_finished()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.watchdog is not None:
            self.watchdog.pause()  # a batch the module skipped (on_train_batch_start returned -1) has no end

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.watchdog is not None:
            self.watchdog.pause()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        detach, self._detach = self._detach, None
        if detach is not None:
            detach()
        restore_hooks(self)
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.stop()
