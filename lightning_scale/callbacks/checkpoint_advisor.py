"""``CheckpointIntervalAdvisor``: the checkpoint interval that loses the least time to failures."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lightning_scale._lightning_compat import should_accumulate
from lightning_scale.callbacks import _telemetry as telemetry
from lightning_scale.core.checkpoint.interval import daly_interval, young_interval

__all__ = ["CheckpointIntervalAdvisor"]


class CheckpointIntervalAdvisor(telemetry.TimedCallback):
    """Log ``checkpoint/save_s`` (the mean time ``trainer.save_checkpoint`` blocked training; an
    async save's staging), ``checkpoint/interval_young_s``, ``checkpoint/interval_daly_s`` and
    ``checkpoint/interval_daly_steps`` (at the recent step time) for a mean time between
    failures of ``mtbf_hours`` (:mod:`lightning_scale.core.checkpoint.interval`). Nothing is logged
    before the first save has been timed. Rank-local times, no synchronisation.

    Args:
        mtbf_hours: mean time between failures of the whole job (a node's MTBF / nodes).
    """

    def __init__(self, mtbf_hours: float) -> None:
        if isinstance(mtbf_hours, bool) or not isinstance(mtbf_hours, (int, float)) or not mtbf_hours > 0:
            raise ValueError(f"mtbf_hours={mtbf_hours!r} must be a positive number of hours between failures.")
        super().__init__()
        self.mtbf_s = float(mtbf_hours) * 3600
        self._saves: list[float] = []
        self._step_start: tuple[float, int] | None = None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._saves = []
        self._cleanups.append(telemetry.on_checkpoint_saved(trainer, self._saves.append))
        self._clock = telemetry.TrainClock()
        self._step_start = None

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if should_accumulate(trainer):
            return
        now = self._clock.now()
        if self._step_start is None:
            self._step_start = (now, trainer.global_step)
        if not (self._saves and telemetry.should_log(trainer)):
            return
        cost = sum(self._saves) / len(self._saves)
        out = {
            "checkpoint/save_s": cost,
            "checkpoint/interval_young_s": young_interval(cost, self.mtbf_s),
            "checkpoint/interval_daly_s": daly_interval(cost, self.mtbf_s),
        }
        start, step0 = self._step_start
        if trainer.global_step > step0:
            # Saves counted out of the step time: the interval is in steps of training.
            seconds_per_step = max(1e-9, (now - start - sum(self._saves)) / (trainer.global_step - step0))
            out["checkpoint/interval_daly_steps"] = out["checkpoint/interval_daly_s"] / seconds_per_step
        telemetry.publish(trainer, out)
