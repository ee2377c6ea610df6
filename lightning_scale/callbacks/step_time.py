"""``StepTimeBreakdown``: where a training step's time goes, and the pipeline's measured bubble."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lightning_scale.callbacks import _telemetry as telemetry
from lightning_scale.core.partition import bubble_fraction
from lightning_scale.core.pipeline_timing import TimerReader

__all__ = ["StepTimeBreakdown"]

_PARTS = ("data", "compute", "comm", "optimizer", "checkpoint")


class StepTimeBreakdown(telemetry.TimedCallback):
    """Log ``train/step_time/{data,compute,comm,optimizer,checkpoint,total}`` (seconds per optimizer step,
    averaged over the processes and the steps since the last logging step) and, under pipeline
    parallelism, ``train/step_time/bubble``, ``pipeline/bubble_measured`` next to
    ``pipeline/bubble_predicted`` and ``pipeline/stage{k}/{compute,idle}`` per stage.

    - ``data``: from the end of one batch to the start of the next (fetching, transfer, loop), less
      checkpointing in between;
    - ``compute``: forward and backward (with the gradient reductions overlapped with them), from
      the batch's start to ``on_before_optimizer_step``; under a pipeline, the stages' own compute;
    - ``comm``: synchronous ``torch.distributed`` collectives called from Python during the steps
      (the gradient-norm and loss reductions, the pipeline's loss broadcast, tied-weight sums),
      taken out of the span they fell in. DDP's bucketed all-reduces (C++), FSDP2's asynchronous
      gathers and DTensor's functional collectives overlap with compute and are not separable
      here: they stay in ``compute`` (:func:`lightning_scale.callbacks._telemetry.on_collective`);
    - ``optimizer``: from there to the batch's end: clipping, the update;
    - ``checkpoint``: the time ``trainer.save_checkpoint`` blocks (for an async save, its staging);
    - ``bubble``: the pipeline schedule's time not spent in this rank's stages (``forward_one_chunk``,
      ``backward_one_chunk``, ``backward_weight_one_chunk``, timed inside the schedule): the
      bubble, plus point-to-point waits. ``pipeline/bubble_measured`` is its share of the
      schedule's time; ``pipeline/bubble_predicted`` the schedule's ideal share
      (``core.partition.bubble_fraction``).

    Validation inside ``fit`` is excluded. One all-reduce at each logging step.
    """

    def __init__(self) -> None:
        super().__init__()
        self._reset()

    def _reset(self) -> None:
        self._sums = dict.fromkeys(_PARTS, 0.0)
        self._steps = 0
        self._pending = 0.0  # checkpoint and communication time since the last mark, out of the span it fell in
        self._mark: float | None = None
        self._optimizer_at: float | None = None

    # ------------------------------------------------------------------ set-up

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._clock = telemetry.TrainClock()
        self._reset()
        self._pipeline = getattr(trainer.strategy, "pipeline", None)
        self._cleanups.append(telemetry.on_checkpoint_saved(trainer, self._saved))
        self._cleanups.append(telemetry.on_collective(self._communicated))
        self._timer = TimerReader(self._pipeline.timer) if self._pipeline is not None else None

    def _saved(self, seconds: float) -> None:
        self._sums["checkpoint"] += seconds
        self._pending += seconds

    def _communicated(self, seconds: float) -> None:
        if self._mark is not None:  # within training steps only
            self._sums["comm"] += seconds
            self._pending += seconds

    # ------------------------------------------------------------------ spans

    def _close(self, part: str, now: float) -> None:
        assert self._mark is not None
        self._sums[part] += max(0.0, now - self._mark - self._pending)
        self._pending = 0.0
        self._mark = now

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        now = self._clock.now()
        if self._mark is None:
            self._mark, self._pending = now, 0.0
        else:
            self._close("data", now)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._mark is not None:
            self._close("compute", self._clock.now())
            self._optimizer_at = self._mark

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._mark is None:
            return
        self._close("optimizer" if self._optimizer_at is not None else "compute", self._clock.now())
        self._optimizer_at = None
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return
        self._steps += 1
        if telemetry.should_log(trainer):
            telemetry.publish(trainer, self.compute(trainer))

    def compute(self, trainer: Trainer) -> dict[str, float]:
        """Per-step means over the processes since the last call (one all-reduce when distributed)."""
        values = [self._sums[p] for p in _PARTS] + [float(self._steps)]
        runner = self._pipeline
        pp = runner.pp_size if runner is not None else 0
        if runner is not None:
            step_s, compute_s, _ = self._timer.take()
            stage = [0.0] * (2 * pp)
            stage[2 * runner.pp_rank], stage[2 * runner.pp_rank + 1] = compute_s, step_s - compute_s
            values += [step_s, compute_s, *stage]
        totals = telemetry.reduce_sum(trainer, values)
        world, steps = trainer.world_size, totals[len(_PARTS)] / trainer.world_size
        self._sums, self._steps = dict.fromkeys(_PARTS, 0.0), 0
        if steps <= 0:
            return {}
        per_step = {p: totals[i] / world / steps for i, p in enumerate(_PARTS)}
        out = {f"train/step_time/{p}": v for p, v in per_step.items()}
        if runner is not None:
            step_s, compute_s = totals[len(_PARTS) + 1], totals[len(_PARTS) + 2]
            idle = (step_s - compute_s) / world / steps
            out["train/step_time/compute"] = max(0.0, per_step["compute"] - idle)
            out["train/step_time/bubble"] = idle
            out["pipeline/bubble_measured"] = (step_s - compute_s) / step_s if step_s > 0 else 0.0
            out["pipeline/bubble_predicted"] = bubble_fraction(
                runner.schedule_name, pp, runner.microbatches, runner.num_stages // pp
            )
            ranks_per_stage = world / pp
            stage_totals = totals[len(_PARTS) + 3:]
            for k in range(pp):
                out[f"pipeline/stage{k}/compute"] = stage_totals[2 * k] / ranks_per_stage / steps
                out[f"pipeline/stage{k}/idle"] = stage_totals[2 * k + 1] / ranks_per_stage / steps
        out["train/step_time/total"] = sum(out[f"train/step_time/{p}"] for p in (*_PARTS, "bubble") if
                                           f"train/step_time/{p}" in out)  # fmt: skip
        return out
