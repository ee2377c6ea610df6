"""``HangWatchdog``: the hang watchdog for a fit under another strategy (Lightning's ``DDPStrategy``, ``FSDPStrategy``).

A training step that runs far longer than the recent ones is a hang; every rank then writes its stacks to
``<run_dir>/hang/``, one summary names the ranks that never reached the collective the others wait in, and
every process exits with :data:`~lightning_scale.core.resilience.HANG_EXIT_CODE`, so torchrun ``--max-restarts``
or a requeued job relaunches it and the relaunch resumes from ``"latest"``.

The mechanism is :class:`lightning_scale.core.resilience.watchdog.StepWatchdog`; here, the Lightning hooks that
beat its heart. ``HybridParallelStrategy`` has the same watchdog built in, beaten by its own per-step methods
(:mod:`lightning_scale.strategies.hybrid.resilience`: no callback dispatch a step), set by its ``hang_timeout``
option; under it this callback is refused unless ``hang_timeout=0`` turns the strategy's off.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_scale.core.resilience.watchdog import HANG_EXIT_CODE, StepWatchdog, hang_timeout_policy
from lightning_scale.strategies.hybrid.strategy import HybridParallelStrategy

__all__ = ["HANG_EXIT_CODE", "HangWatchdog"]


class HangWatchdog(Callback):
    """Detect a stalled training step on any rank, dump every rank's stacks, exit with :data:`HANG_EXIT_CODE`.

    Each rank's training loop sets a heartbeat at the batch's start, before the backward, before the
    optimizer step and at the batch's end (no collective, no host sync); a thread of the rank compares the
    running step with its limit. The limit, by default, is the larger of 120 s and 10x the median of the
    last 20 steps, and at least 600 s for the run's first 3 steps (compilation, warm-up; a resumed run has
    had them). Not timed: the time between steps (the process group's own timeout applies), checkpoints
    (from the first ``on_save_checkpoint`` hook on; first in the callback list, the batch's end stops the
    clock before a checkpoint callback saves), validation and the sanity check (the whole loop: the
    Trainer's ``validating`` state), the ends of epochs.

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

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, HybridParallelStrategy) and strategy.resilience.policy is not None:
            raise ValueError(
                "HangWatchdog is in the Trainer's callbacks, but HybridParallelStrategy runs a hang watchdog of its "
                f"own (hang_timeout={strategy.options.hang_timeout!r}): two would report every hang twice. Remove the "
                "callback and set HybridParallelStrategy(hang_timeout=...) instead, or pass hang_timeout=0 to the "
                "strategy to keep the callback's."
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()
        if self.policy is None:
            return
        self.watchdog = StepWatchdog.for_process(
            self.policy,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            directory=Path(self.dirpath if self.dirpath is not None else trainer.default_root_dir) / "hang",
            grace_s=self.grace_s,
            global_step=lambda: trainer.global_step,
            steps_before=trainer.global_step,  # a resumed run gets no second warm-up allowance
            untimed=lambda: trainer.validating or trainer.sanity_checking,
        )
        self.watchdog.start()

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
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.watchdog is not None:
            self.watchdog.pause()  # the rest of the checkpoint's hooks and its save are not a step

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
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.stop()
