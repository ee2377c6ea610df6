"""A record of each training batch, taken once for every telemetry callback that needs it, and the clock,
the logging-step decision and the group's membership they share (no Lightning callback here but the marker)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer

from lightning_scale._lightning_compat import should_accumulate, should_update_logs
from lightning_scale.core.telemetry.model_facts import batch_shape

__all__ = [
    "READS",
    "CallbackSet",
    "Duration",
    "Step",
    "StepRecorder",
    "TrainClock",
    "clock",
    "each_callback",
    "forget_logging_step",
    "should_log",
    "stamp",
]

clock: Callable[[], float] = time.perf_counter
"""Every telemetry callback's clock (tests patch it)."""


class CallbackSet(Callback):
    """A callback that holds others (``callbacks``), which Lightning sees as one
    (:class:`~lightning_scale.callbacks.group.CallbackGroup`)."""

    callbacks: list[Callback]


def each_callback(trainer: Trainer) -> Iterator[Callback]:
    """The Trainer's callbacks, each group's members in its place."""
    for callback in trainer.callbacks:
        if isinstance(callback, CallbackSet):
            yield from callback.callbacks
        else:
            yield callback


class TrainClock:
    """Training time: the clock minus the time spent in validation inside ``fit``."""

    def __init__(self) -> None:
        self._paused_at: float | None = None
        self._paused = 0.0

    def now(self) -> float:
        return (self._paused_at if self._paused_at is not None else clock()) - self._paused

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = clock()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused += clock() - self._paused_at
            self._paused_at = None


class Step:
    """One training batch. Times are the recorder's :class:`TrainClock` readings (validation left out);
    ``edges`` the same edges as CUDA events when the recorder times on the GPU."""

    __slots__ = (
        "accumulate",
        "after",
        "batch",
        "counted",
        "data",
        "edges",
        "end",
        "global_step",
        "index",
        "log",
        "optimizer",
        "samples",
        "seen",
        "seq_len",
        "start",
        "wait_from",
        "wall",
    )

    def __init__(self, index: int, seen: bool, start: float | None) -> None:
        self.index = index
        """The batch's place in the fit (0, 1, ...); collectives are attributed to its spans by it (``phase``)."""
        self.seen = seen
        """Whether the recorder saw the batch start."""
        self.start = start
        """At the batch's start. Each time is None where the recorder does not read it (``reads``)."""
        self.optimizer: float | None = None
        """At the first ``on_before_optimizer_step`` (None also: no optimizer step in this batch)."""
        self.end: float | None = None
        """At the batch's end, before any callback's work there."""
        self.after: float | None = None
        """Once every callback of the recorder's owner finished the batch's end (logging step included)."""
        self.wait_from: float | None = None
        """The previous batch's ``after``: from there to ``start`` the loop waited for this batch."""
        self.data: tuple[Any, Any] | None = None
        """The data span's edges (on the span clock: ``edges``' kind), from the previous batch's end."""
        self.edges: tuple[Any, Any, Any] | None = None
        """``(start, optimizer, end)`` as CUDA events when the recorder times spans on the GPU, else None."""
        self.samples = self.seq_len = 0
        self.counted: int | None = None
        """The batch's tokens by the recorder's ``count_fn`` (None without one)."""
        self.batch: Any = None
        """The batch itself, kept for the first batch of each sequence length only (FLOPs are counted on it)."""
        self.accumulate = False
        self.log = False
        self.wall: float | None = None
        self.global_step: int | None = None
        """Wall time and ``global_step`` at the start: the fit's first batch only."""

    def span_edges(self) -> tuple[Any, Any, Any]:
        """``(start, optimizer, end)`` on the span clock."""
        return self.edges if self.edges is not None else (self.start, self.optimizer, self.end)


READS = ("start", "optimizer", "end", "after")
"""The clock readings a :class:`StepRecorder` can take per batch (``Step``'s times of those names)."""


class StepRecorder:
    """Takes a :class:`Step` per training batch, once for every telemetry callback that needs it:
    ``batch_start``, ``optimizer`` and ``batch_end`` from the three per-step hooks, ``pause``/``resume``
    around validation. A telemetry callback's per-step work is bookkeeping (clock readings, the batch's size,
    the accumulation and logging decisions); done by each callback in hooks of its own it was some thirty-five
    small Python functions a step, each run with the caches the optimizer step emptied (5-15 us apiece on a
    CPU, measured: the callbacks cost the number of distinct functions, not their work). A
    :class:`~lightning_scale.callbacks.group.CallbackGroup` holds one recorder for its :class:`SharedTelemetry`
    members, which fold the records into their sums at logging steps (``fold_steps``); alone, each records
    its own steps.

    ``phase`` names the span running now, so that a collective or a checkpoint save can be taken out of the
    span it fell in: ``3 k`` the data span before batch ``k``, ``3 k + 1`` its forward and backward, ``3 k + 2``
    its optimizer step, ``-1`` none (before the first batch, and after validation on a GPU, where events do
    not pause)."""

    def __init__(self) -> None:
        self.reset()

    def reset(
        self,
        *,
        cuda: bool = False,
        sizes: bool = False,
        shape_fn: Callable[[Any], tuple[int, int]] | None = None,
        count_fn: Callable[[Any], Any] | None = None,
        reads: Iterable[str] = READS,
    ) -> None:
        """A new fit. ``cuda``: span edges are CUDA events too; ``sizes``: each batch's samples and tokens are
        taken (``shape_fn``, ``count_fn``: see ``Throughput``'s ``batch_shape`` and ``token_count``); ``reads``:
        the clock readings taken (of :data:`READS`)."""
        self.clock = TrainClock()
        self.cuda, self.sizes, self.shape_fn, self.count_fn = cuda, sizes, shape_fn, count_fn
        reads = frozenset(reads)
        if not reads <= set(READS):
            raise ValueError(f"reads={sorted(reads)} may only name {READS}.")
        self._start, self._optimizer, self._end, self._after = (name in reads for name in READS)
        self.index = 0
        self.phase = -1
        self.paused = False
        self.current: Step | None = None
        self.last: Step | None = None
        self._cut: Any = None
        self._seen: set[int] = set()

    def _edge(self, now: float) -> Any:
        return stamp(True) if self.cuda else now

    def batch_start(self, trainer: Any, batch: Any) -> None:
        if self._start:
            now = self.clock.now()
            step = self.current = Step(self.index, True, now)
            edge = self._edge(now)
            last = self.last
            if last is not None:
                step.wait_from = last.after
                end = last.edges[2] if last.edges is not None else last.end
                if end is not None:
                    step.data = (end, self._cut if self._cut is not None else edge)
            if self.cuda:
                step.edges = (edge, None, None)
        else:
            step = self.current = Step(self.index, True, None)
        self._cut = None
        if self.index == 0:
            step.wall, step.global_step = time.time(), trainer.global_step
        if self.sizes:
            self._size(step, batch)
        self.phase = 3 * self.index + 1

    def _size(self, step: Step, batch: Any) -> None:
        shape = self.shape_fn(batch) if self.shape_fn is not None else batch_shape(batch)
        if shape is None:
            raise ValueError(
                f"Cannot tell the samples and tokens of a batch of type {type(batch).__name__}: no tensor found. "
                "Pass batch_shape=lambda batch: (samples, tokens_per_sample)."
            )
        step.samples, step.seq_len = int(shape[0]), int(shape[1])
        if step.seq_len not in self._seen:
            self._seen.add(step.seq_len)
            step.batch = batch
        if self.count_fn is not None:
            count = self.count_fn(batch)
            if isinstance(count, torch.Tensor):
                count = int(count.item())  # one read of the batch's count; give an int to avoid it
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise TypeError(
                    f"token_count returned {count!r}; it must return the batch's tokens as a non-negative int."
                )
            step.counted = count

    def optimizer(self) -> None:
        step = self.current
        if step is not None and step.optimizer is None and self._optimizer:
            step.optimizer = now = self.clock.now()
            if step.edges is not None:
                step.edges = (step.edges[0], self._edge(now), None)
            self.phase = 3 * step.index + 2

    def batch_end(self, trainer: Any) -> Step:
        """The batch's record, with ``accumulate`` and ``log`` (:func:`lightning_scale.callbacks._telemetry.should_log`)
        decided; one without a start when the recorder did not see the batch start."""
        step = self.current
        if step is None:
            step = Step(self.index, False, None)
        if self._end:
            step.end = now = self.clock.now()
            if step.edges is not None:
                step.edges = (step.edges[0], step.edges[1], self._edge(now))
        step.accumulate = should_accumulate(trainer)
        step.log = not step.accumulate and should_log(trainer)
        self.current = None
        self.last = step
        self.index += 1
        self.phase = 3 * self.index
        return step

    def finish(self, step: Step) -> None:
        """The owner's work at the batch's end is done: the wait for the next batch starts."""
        if self._after:
            step.after = self.clock.now()

    def pause(self) -> None:
        """Validation starts: its time is not training time. On a GPU the data span ends here."""
        self.clock.pause()
        self.paused = True
        if self.cuda and self.last is not None and self._cut is None:
            self._cut = self._edge(0.0)
            self.phase = -1

    def resume(self) -> None:
        self.clock.resume()
        self.paused = False


class Duration:
    """A span's length, read when it is needed: two host-clock readings, or two CUDA events recorded on
    the current stream (their GPU time apart, read once the later one completed: no synchronisation
    when they are taken, one when a logging step reads them)."""

    __slots__ = ("end", "start")

    def __init__(self, start: Any, end: Any) -> None:
        self.start, self.end = start, end

    def seconds(self) -> float:
        if isinstance(self.start, float):
            return self.end - self.start
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


def stamp(cuda: bool) -> Any:
    """Now: a CUDA event recorded on the current stream (``cuda``), else :data:`clock`'s reading."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return clock()


_LOGGING = "_lightning_scale_logging_batch"


def should_log(trainer: Trainer) -> bool:
    """At Lightning's logging steps (``Trainer(log_every_n_steps=...)``), once the accumulation window closed.
    Decided once per training batch, for every callback alike (a later callback setting ``should_stop``, which
    Lightning also logs at, does not split them: each takes part in the logging step's reduction or none does)."""
    batch = trainer.fit_loop.epoch_loop.batch_progress.total.ready  # counts every batch of the fit, never repeats
    decided = trainer.__dict__.get(_LOGGING)
    if decided is not None and decided[0] == batch:
        return decided[1]
    logging = should_update_logs(trainer) and not should_accumulate(trainer)
    trainer.__dict__[_LOGGING] = (batch, logging)
    return logging


def forget_logging_step(trainer: Trainer) -> None:
    """At a fit's start: a fit resumed from an earlier checkpoint counts its batches from there again, so
    :func:`should_log`'s decision for a batch of an earlier fit must not stand for one of this fit."""
    trainer.__dict__.pop(_LOGGING, None)
