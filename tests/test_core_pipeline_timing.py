"""StageTimer and TimerReader against a clock the test moves: exact step and compute seconds."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_scale.core.pipeline import timing
from lightning_scale.core.pipeline.timing import STAGE_COMPUTE, StageTimer, TimerReader


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Stage:
    """What torch's schedules call per micro-batch; each call moves the clock by its cost in seconds."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def forward_one_chunk(self, chunk: int) -> str:
        self.clock.now += 2.0
        return f"out{chunk}"

    def backward_one_chunk(self, chunk: int, full_backward: bool = True) -> None:
        self.clock.now += 3.0
        if full_backward:
            self.backward_weight_one_chunk(chunk)  # nested inside a compute call: counted once

    def backward_weight_one_chunk(self, chunk: int) -> None:
        self.clock.now += 1.0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=clock))
    return clock


def _step(timer: StageTimer, stage: _Stage, clock: _Clock) -> None:
    with timer.span("step"):
        clock.now += 0.5  # waiting for the previous stage: idle
        assert stage.forward_one_chunk(0) == "out0"
        stage.backward_one_chunk(0)
        clock.now += 0.25


def test_compute_is_the_stages_calls_and_the_step_adds_the_waits(clock: _Clock) -> None:
    timer, stage = StageTimer(torch.device("cpu")), _Stage(clock)
    timer.wrap(stage)
    assert timer.read() == (0.0, 0.0, 0)
    _step(timer, stage, clock)
    assert timer.read() == (6.75, 6.0, 1)  # 0.5 + 2 + (3 + 1) + 0.25, of which 2 + 4 computing
    _step(timer, stage, clock)
    assert timer.read() == (13.5, 12.0, 2)


def test_wrapping_twice_times_once_and_missing_methods_are_skipped(clock: _Clock) -> None:
    timer, stage = StageTimer(torch.device("cpu")), _Stage(clock)
    timer.wrap(stage)
    timer.wrap(stage)
    stage.forward_one_chunk(1)
    assert timer.read() == (0.0, 2.0, 0)

    partial = SimpleNamespace(forward_one_chunk=lambda: clock.__setattr__("now", clock.now + 0.5))
    timer.wrap(partial)
    assert [name for name in STAGE_COMPUTE if hasattr(partial, name)] == ["forward_one_chunk"]
    partial.forward_one_chunk()
    assert timer.read() == (0.0, 2.5, 0)


def test_a_failed_call_is_not_counted_and_leaves_the_timer_usable(clock: _Clock) -> None:
    timer, stage = StageTimer(torch.device("cpu")), _Stage(clock)

    def broken(chunk: int) -> None:
        clock.now += 7.0
        raise RuntimeError("stage failed")

    stage.backward_weight_one_chunk = broken  # type: ignore[method-assign]
    timer.wrap(stage)
    with pytest.raises(RuntimeError, match="stage failed"), timer.span("step"):
        stage.backward_one_chunk(0)
    assert timer.read() == (0.0, 0.0, 0)
    stage.forward_one_chunk(0)  # the failed nesting is undone: this call is an outer one again
    assert timer.read() == (0.0, 2.0, 0)


class _Event:
    """``torch.cuda.Event`` on the test's clock: ``elapsed_time`` in milliseconds."""

    synchronized: list[Any] = []

    def __init__(self, clock: _Clock, enable_timing: bool) -> None:
        assert enable_timing
        self.clock, self.at = clock, None

    def record(self) -> None:
        self.at = self.clock.now

    def synchronize(self) -> None:
        _Event.synchronized.append(self)

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1000


def test_on_cuda_spans_are_events_resolved_with_one_synchronisation_when_read(
    clock: _Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    _Event.synchronized = []
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: _Event(clock, enable_timing))
    timer, stage = StageTimer(torch.device("cuda")), _Stage(clock)
    timer.wrap(stage)
    _step(timer, stage, clock)
    _step(timer, stage, clock)
    assert _Event.synchronized == []  # nothing waits for the device until a reader asks

    assert timer.read() == pytest.approx((13.5, 12.0, 2), rel=1e-12)  # milliseconds back to seconds
    assert len(_Event.synchronized) == 1  # the last event only: the ones before it have finished too
    assert timer.read() == pytest.approx((13.5, 12.0, 2), rel=1e-12)
    assert len(_Event.synchronized) == 1


def test_each_reader_takes_its_own_differences(clock: _Clock) -> None:
    timer, stage = StageTimer(torch.device("cpu")), _Stage(clock)
    timer.wrap(stage)
    early = TimerReader(timer)
    _step(timer, stage, clock)
    late = TimerReader(timer)
    _step(timer, stage, clock)
    assert early.take() == (13.5, 12.0, 2)
    assert late.take() == (6.75, 6.0, 1)
    assert early.take() == (0.0, 0.0, 0)
