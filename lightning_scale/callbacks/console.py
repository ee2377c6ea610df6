"""``ConsoleLogger``: one plain line of metrics every few steps, from global rank 0."""

from __future__ import annotations

import logging
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_scale._lightning_compat import batches_that_stepped

__all__ = ["CONSOLE_LOG", "ConsoleLogger"]

CONSOLE_LOG = logging.getLogger("lightning_scale.console")
"""Every printed line is logged here too (INFO). It has no handler and does not propagate, so the
console shows each line once whatever the root logger does; give it a file handler to keep them
(``lightning-scale-train`` writes them to the run's ``train.log``)."""
CONSOLE_LOG.propagate = False


class ConsoleLogger(Callback):
    """Print ``step 120/300 | train/loss 2.3415 | lr 2.9e-03 | 1.82 s/10 steps`` lines.

    Meant for logs and non-interactive terminals, where a progress bar is noise. Reads the
    metrics already logged through ``self.log`` (``trainer.callback_metrics``), so it adds no
    synchronisation; prints on global rank 0 only, and logs each line to :data:`CONSOLE_LOG`. It runs
    after the other callbacks of a step (it moves itself behind them, ahead of the checkpoint
    callbacks), so a line shows the figures they published at that step. Metrics logged only on the steps the loggers write
    (``train/grad_norm``, ``precision/*``) show their last logged value: make ``every_n_steps`` a
    multiple of ``Trainer(log_every_n_steps=...)``.

    Args:
        every_n_steps: print after every this many optimizer steps (and after the last one).
        metrics: names of logged metrics to print, in order; missing ones are skipped.
    """

    def __init__(self, every_n_steps: int = 25, metrics: tuple[str, ...] | list[str] = ("train/loss",)) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.metrics = tuple(metrics)
        self._last_time: float | None = None
        self._last_step = 0

    @staticmethod
    def _fmt(name: str, value: Any) -> str:
        value = float(value)
        return f"{name} {value:.4f}" if abs(value) >= 1e-3 else f"{name} {value:.3e}"

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self not in trainer.callbacks:
            return
        others = [c for c in trainer.callbacks if c is not self]
        checkpoints = [c for c in others if isinstance(c, Checkpoint)]
        # A new list: Lightning is iterating over the current one to call this hook.
        trainer.callbacks = [*[c for c in others if not isinstance(c, Checkpoint)], self, *checkpoints]

    @staticmethod
    def emit(line: str) -> None:
        """Print ``line`` and log it to :data:`CONSOLE_LOG`."""
        print(line, flush=True)
        CONSOLE_LOG.info(line)

    @override
    @rank_zero_only
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_time, self._last_step = time.perf_counter(), trainer.global_step

    @override
    @rank_zero_only
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        last = step == trainer.max_steps
        if step == self._last_step or (step % self.every_n_steps and not last):
            return
        parts = [f"step {step}" + (f"/{trainer.max_steps}" if trainer.max_steps > 0 else "")]
        logged = trainer.callback_metrics  # (each reading of the property assembles the metrics anew)
        parts += [self._fmt(m, logged[m]) for m in self.metrics if m in logged]
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.2e}")
        now = time.perf_counter()
        if self._last_time is not None:
            parts.append(f"{(now - self._last_time) / (step - self._last_step):.3f} s/step")
        self._last_time, self._last_step = now, step
        self.emit(" | ".join(parts))

    @override
    @rank_zero_only
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        values = [self._fmt(k, v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")]
        if values:
            # Outside a fit (trainer.validate), the step the loggers got: global_step is 0 there, even for
            # the weights a resumed run validates before its fit.
            step = trainer.global_step if trainer.state.fn == TrainerFn.FITTING else batches_that_stepped(trainer)
            self.emit(f"validation at step {step} | " + " | ".join(values))
