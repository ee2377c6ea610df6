"""Compute and step time of this rank's pipeline stages, taken inside the schedule. No Lightning.

The whole pipeline step runs inside one call (``schedule.step``), so hooks outside it cannot tell
compute from waiting. :class:`StageTimer` wraps each stage's ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk`` (what torch's schedules call for every
micro-batch); what the step takes beyond them is the rank's idle time: the bubble, plus waits for
point-to-point transfers. On CUDA the spans are CUDA events, resolved (one synchronisation) only
when :meth:`StageTimer.read` is called at a logging step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_scale.core.compat import PIPELINE_STAGE_COMPUTE

__all__ = ["STAGE_COMPUTE", "StageTimer", "TimerReader"]

STAGE_COMPUTE = PIPELINE_STAGE_COMPUTE


class StageTimer:
    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._events: list[tuple[str, Any, Any]] = []
        self._totals = {"step": 0.0, "compute": 0.0}
        self.steps = 0
        self._depth = 0  # a compute call inside another (a full backward's weight part) is not counted twice

    def wrap(self, stage: Any) -> None:
        """Time ``stage``'s compute calls (instance attributes shadow its methods)."""
        for name in STAGE_COMPUTE:
            method = getattr(stage, name, None)
            if method is None or getattr(method, "_timed", False):
                continue

            def timed(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
                with self.span("compute"):
                    return _method(*args, **kwargs)

            timed._timed = True  # type: ignore[attr-defined]
            setattr(stage, name, timed)

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        nested = kind == "compute"
        self._depth += nested
        outer = kind == "step" or self._depth == 1
        try:
            if not outer:
                yield
            elif self._cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self._events.append((kind, start, end))
            else:
                begin = time.perf_counter()
                yield
                self._totals[kind] += time.perf_counter() - begin
        finally:
            self._depth -= nested
        if kind == "step":
            self.steps += 1

    def read(self) -> tuple[float, float, int]:
        """``(step seconds, compute seconds, steps)`` so far: cumulative, so several readers can take
        differences of their own."""
        if self._events:
            self._events[-1][2].synchronize()
            for kind, start, end in self._events:
                self._totals[kind] += start.elapsed_time(end) / 1000
            self._events.clear()
        return self._totals["step"], self._totals["compute"], self.steps


class TimerReader:
    """One reader's differences of a :class:`StageTimer`'s totals."""

    def __init__(self, timer: StageTimer) -> None:
        self.timer = timer
        self._last = timer.read()

    def take(self) -> tuple[float, float, int]:
        """``(step seconds, compute seconds, steps)`` since the last call (or since this reader was made)."""
        now = self.timer.read()
        out = (now[0] - self._last[0], now[1] - self._last[1], now[2] - self._last[2])
        self._last = now
        return out
