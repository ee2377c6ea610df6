"""``StepTimeBreakdown``: where a training step's time goes, and the pipeline's measured bubble."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lightning_scale.callbacks import _telemetry as telemetry
from lightning_scale.core.pipeline.partition import bubble_fraction
from lightning_scale.core.pipeline.timing import TimerReader

__all__ = ["StepTimeBreakdown"]

_PARTS = ("data", "compute", "comm", "optimizer", "checkpoint")


class StepTimeBreakdown(telemetry.SharedTelemetry):
    """Log ``train/step_time/{data,compute,comm,optimizer,checkpoint,total}`` (seconds per optimizer step,
    averaged over the processes and the steps since the last logging step), ``train/step_time/sync`` under a
    strategy that keeps ``sync_stats()`` (``HybridParallelStrategy``) and, under pipeline
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
    - ``sync``: the seconds the training loop was blocked waiting on the data-parallel exchange of Local SGD or
      DiLoCo (the strategy's ``sync_stats()["blocked_s"]``; 0 for ``every_step``, whose all-reduces DDP overlaps
      with the backward). The exchange runs in the strategy's optimizer step, so it is taken out of
      ``optimizer`` (never more than ``optimizer`` held): ``total`` still adds up the parts;
    - ``checkpoint``: the time ``trainer.save_checkpoint`` blocks (for an async save, its staging);
    - ``bubble``: the pipeline schedule's time not spent in this rank's stages (``forward_one_chunk``,
      ``backward_one_chunk``, ``backward_weight_one_chunk``, timed inside the schedule): the
      bubble, plus point-to-point waits. ``pipeline/bubble_measured`` is its share of the
      schedule's time; ``pipeline/bubble_predicted`` the schedule's ideal share
      (``core.pipeline.partition.bubble_fraction``).

    Validation inside ``fit`` is excluded. The sums go into the logging step's one all-reduce (shared with
    the other telemetry callbacks).

    On a GPU every span edge is a CUDA event recorded on the current stream, and the spans are read at
    logging steps: each span is the GPU's time between its edges (kernels launched ahead of the host
    land in the span they run in, not in whichever later span happens to synchronise), and nothing
    synchronises between logging steps. Collectives called from Python on CUDA tensors are timed by
    events too (an NCCL call returns before its transfer ends). The pipeline's stage timings
    (``pipeline/*``) are host times.
    """

    cuda_edges = True
    reads = ("start", "optimizer", "end")

    def __init__(self) -> None:
        super().__init__()
        self._cuda = False
        self._sync: Callable[[], Mapping[str, Any]] | None = None
        self._blocked = 0.0
        self._reset()

    def _reset(self) -> None:
        self._sums = dict.fromkeys(_PARTS, 0.0)
        self._steps = 0
        self._spans: list[tuple[str, telemetry.Duration, Sequence[telemetry.Duration]]] = []
        self._comm: list[telemetry.Duration] = []
        self._inside: dict[int, list[telemetry.Duration]] = {}  # checkpoints and collectives by the span they fell in

    # ------------------------------------------------------------------ set-up

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._cuda = self.steps.cuda  # the recorder's edges are CUDA events (on a GPU)
        self._reset()
        self._pipeline = getattr(trainer.strategy, "pipeline", None)
        self._cleanups.append(telemetry.on_checkpoint_saved(trainer, self._saved))
        self._cleanups.append(telemetry.on_collective(self._communicated))
        self._timer = TimerReader(self._pipeline.timer) if self._pipeline is not None else None
        self._sync = telemetry.sync_stats_reader(trainer)  # alike on every process: the numbers reduced match
        self._blocked = 0.0  # the strategy's blocked_s at the last logging step

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._sync is not None:  # from here (a strategy may count on from the checkpoint it resumed)
            self._blocked = float(self._sync().get("blocked_s", 0.0))

    def _within(self, duration: telemetry.Duration) -> bool:
        """Take ``duration`` out of the span running now; False when none runs (validation, before the first batch)."""
        steps = self.steps
        if steps.paused or steps.phase < 0:
            return False
        self._inside.setdefault(steps.phase, []).append(duration)
        return True

    def _saved(self, seconds: float) -> None:
        self._sums["checkpoint"] += seconds
        self._within(telemetry.Duration(0.0, seconds))

    def _communicated(self, duration: telemetry.Duration) -> None:
        if self._within(duration):  # within training steps only
            self._comm.append(duration)

    # ------------------------------------------------------------------ spans

    @override
    def fold_steps(self, trainer: Trainer, pl_module: LightningModule, steps: Sequence[telemetry.Step]) -> None:
        inside = self._inside
        for step in steps:
            k = 3 * step.index
            data = inside.pop(k, ())
            if not step.seen:  # a batch whose start was not seen: no span to take anything out of
                for phase in (k + 1, k + 2):
                    inside.pop(phase, None)
                continue
            start, optimizer, end = step.span_edges()
            if step.data is not None:
                self._span("data", *step.data, data)
            if optimizer is None:
                self._span("compute", start, end, inside.pop(k + 1, ()))
            else:
                self._span("compute", start, optimizer, inside.pop(k + 1, ()))
                self._span("optimizer", optimizer, end, inside.pop(k + 2, ()))
            if not step.accumulate:
                self._steps += 1
        if self._comm and not self._cuda:
            self._settle()

    def _span(self, part: str, start: Any, end: Any, inside: Sequence[telemetry.Duration]) -> None:
        if self._cuda:  # events: read at the logging step (reading one waits for it)
            self._spans.append((part, telemetry.Duration(start, end), inside))
        else:  # host clock readings: into the sums now, less what checkpoints and collectives took inside
            self._sums[part] += max(0.0, end - start - sum(d.seconds() for d in inside))

    def _settle(self) -> None:
        """Add the closed spans to the sums (on a GPU at logging steps only: reading an event waits for it)."""
        for part, span, inside in self._spans:
            self._sums[part] += max(0.0, span.seconds() - sum(d.seconds() for d in inside))
        self._sums["comm"] += sum(d.seconds() for d in self._comm)
        self._spans, self._comm = [], []

    @override
    def logging_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Every process contributes to the logging step's reduction.
        telemetry.contribute(
            trainer, self, telemetry.Share(self._take(), "sum", lambda totals: self._metrics(trainer, totals))
        )

    def _take(self) -> list[float]:
        """This process's sums since the last logging step (and its pipeline stage's times), and a new start."""
        self._settle()
        values = [self._sums[p] for p in _PARTS] + [float(self._steps)]
        runner = self._pipeline
        if runner is not None:
            step_s, compute_s, _ = self._timer.take()
            stage = [0.0] * (2 * runner.pp_size)
            stage[2 * runner.pp_rank], stage[2 * runner.pp_rank + 1] = compute_s, step_s - compute_s
            values += [step_s, compute_s, *stage]
        if self._sync is not None:
            values.append(self._take_sync(values))
        self._sums, self._steps = dict.fromkeys(_PARTS, 0.0), 0
        return values

    def _take_sync(self, values: list[float]) -> float:
        """The seconds blocked on the data-parallel exchange since the last logging step, taken out of ``values``'
        optimizer sum (the exchange ran inside those spans)."""
        blocked = float(self._sync().get("blocked_s", 0.0)) if self._sync is not None else 0.0
        waited, self._blocked = telemetry.since(blocked, self._blocked), blocked
        at = _PARTS.index("optimizer")
        taken = min(max(waited, 0.0), values[at])
        values[at] -= taken
        return taken

    def _metrics(self, trainer: Trainer, totals: list[float]) -> dict[str, float]:
        """Per-step means over the processes, from their summed sums."""
        runner = self._pipeline
        pp = runner.pp_size if runner is not None else 0
        world, steps = trainer.world_size, totals[len(_PARTS)] / trainer.world_size
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
            stage_totals = totals[len(_PARTS) + 3 :]
            for k in range(pp):
                out[f"pipeline/stage{k}/compute"] = stage_totals[2 * k] / ranks_per_stage / steps
                out[f"pipeline/stage{k}/idle"] = stage_totals[2 * k + 1] / ranks_per_stage / steps
        if self._sync is not None:  # the last number: blocked on the data-parallel exchange, out of the optimizer's
            out["train/step_time/sync"] = totals[-1] / world / steps
        out["train/step_time/total"] = sum(
            out[f"train/step_time/{p}"] for p in (*_PARTS, "bubble", "sync") if f"train/step_time/{p}" in out
        )
        # layout="auto": the planner's figures for the layout it chose, beside the measured ones.
        chosen = getattr(getattr(trainer.strategy, "auto_layout", None), "chosen", None)
        return out | (chosen.metrics() if chosen is not None else {})
