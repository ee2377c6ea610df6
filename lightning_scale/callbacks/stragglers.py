"""``StragglerMonitor``: ranks whose own work is slower than the median's, with rank and host."""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_scale.callbacks import _telemetry as telemetry
from lightning_scale.core.pipeline.timing import TimerReader
from lightning_scale.core.resilience.preemption import Preempted
from lightning_scale.core.resilience.stragglers import STRAGGLER_EXIT_CODE, SlowStreaks, record_exclusion
from lightning_scale.plugins._checkpoint_commit import commit_checkpoint

__all__ = ["STRAGGLER_EXIT_CODE", "StragglerMonitor", "StragglerRestart"]

_ACTIONS = ("warn", "restart")


class StragglerRestart(Preempted):
    """Raised on every rank after the straggler action committed its checkpoint; the process exits with
    :data:`STRAGGLER_EXIT_CODE` (a :class:`~lightning_scale.callbacks.Preempted`: the run stops with its
    checkpoint committed, and ``lightning-scale-train`` ends its processes as for a preemption)."""


def _probe(device: torch.device, size: int = 128, repeats: int = 3) -> float:
    """Seconds for 2 ``size``-square fp32 matmuls on ``device`` (the fastest of ``repeats`` tries, so
    a moment of preemption does not count: about 1 ms of a CPU core per logging step). On a GPU: 8
    matmuls of 4096-square bf16 timed by CUDA events, milliseconds of tensor-core work, so a slow or
    throttled GPU shows (128-square ones only time their launches). The operand is drawn from a generator
    of its own: the probe leaves the training's random state alone."""
    if device.type == "cuda":
        return _cuda_probe(device, repeats=min(repeats, 3))
    a = torch.randn(size, size, device=device, generator=torch.Generator(device).manual_seed(0))
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        for _ in range(2):
            b = a @ a
        best = min(best, time.perf_counter() - begin)
        del b
    return best


def _cuda_probe(device: torch.device, size: int = 4096, matmuls: int = 8, repeats: int = 3) -> float:
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    with torch.cuda.device(device):
        a = torch.randn(size, size, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(0))
        b = torch.empty_like(a)
        torch.mm(a, a, out=b)  # warm-up: the kernel chosen
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(matmuls):
                torch.mm(a, a, out=b)
            end.record()
            end.synchronize()  # a logging step: the one wait of the probe
            best = min(best, start.elapsed_time(end) / 1e3)
    return best


class StragglerMonitor(telemetry.SharedTelemetry):
    """Flag ranks slower than ``factor`` x the median rank, naming rank, host and ratio.

    Synchronous training makes every rank's wall time per step the same (the fast ones wait for
    the slow one inside the collectives, DDP's buffer broadcast at the start of the forward
    included), so a span that contains a collective cannot name the slow rank. Each rank is timed
    on what it does alone:

    - ``local``: per step, the wait for its data (end of one batch to the start of the next) and,
      under pipeline parallelism, its stages' own compute inside the schedule;
    - ``probe``: at each logging step, a fixed matmul on its device (the fastest of a few tries):
      a slow or throttled device shows here even when its slowness hides in collectives.

    Both are gathered at Lightning's logging steps (two numbers per rank in the logging step's one
    all-reduce, shared with the other telemetry callbacks); global
    rank 0 warns naming each slow rank, its host, which measure and its ratio, and every rank logs
    ``stragglers/count`` and ``stragglers/max_ratio``. ``flagged`` keeps
    ``(step, rank, host, ratio)`` of every report.

    With ``action="restart"``, a rank flagged at ``patience`` consecutive logging intervals (by either
    measure) stops the run so that it can restart without that rank's host: every rank commits a checkpoint
    of that step (``checkpoints/step-NNNNNN``, as a preemption does), global rank 0 writes
    ``<default_root_dir>/stragglers/exclude.json`` (the rank, its host, its ratios, and every host excluded
    from the run so far) and a line of ``stragglers/events.jsonl``, and every process exits with
    :data:`STRAGGLER_EXIT_CODE` (76). The ranks decide from the all-reduced figures, which they all hold
    alike: the same decision at the same step, with no collective beyond the logging step's all-reduce.

    Args:
        factor: a rank is slow above ``factor`` x the median (``> 1``).
        probe: run the matmul probe at logging steps.
        action: ``"warn"`` (report only) or ``"restart"`` (checkpoint and exit, as above).
        patience: with ``"restart"``, the consecutive logging intervals a rank must be flagged at.
    """

    def __init__(
        self, factor: float = 1.5, *, probe: bool = True, action: Literal["warn", "restart"] = "warn", patience: int = 3
    ) -> None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
            raise ValueError(f"factor={factor!r} must be a number above 1 (a slow rank's time over the median's).")
        if action not in _ACTIONS:
            raise ValueError(
                f"action={action!r} is not an action. Pass 'warn' (report slow ranks only) or 'restart' (after "
                f"`patience` slow logging intervals in a row, checkpoint and exit with status {STRAGGLER_EXIT_CODE})."
            )
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(
                f"patience={patience!r} must be an integer of 1 or more: the consecutive logging intervals a rank "
                f"is flagged at before action='restart' stops the run (e.g. patience=3)."
            )
        super().__init__()
        self.factor = float(factor)
        self.probe = probe
        self.action = action
        self.patience = patience
        self.streaks = SlowStreaks(patience)
        self.flagged: list[tuple[int, int, str, float]] = []
        self._last_ratios: dict[int, float] = {}  # the last logging step's flagged ranks: their worst ratio
        self._hosts: list[str] = []
        self._local = 0.0
        self._steps = 0
        self._timer: TimerReader | None = None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        host = socket.gethostname()
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            hosts: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(hosts, host)  # once per fit
            self._hosts = [str(h) for h in hosts]
        else:
            self._hosts = [host]
        pipeline = getattr(trainer.strategy, "pipeline", None)
        self._timer = TimerReader(pipeline.timer) if pipeline is not None else None
        self._local, self._steps = 0.0, 0
        self.streaks = SlowStreaks(self.patience)

    reads = ("start", "after")

    @override
    def fold_steps(self, trainer: Trainer, pl_module: LightningModule, steps: Sequence[telemetry.Step]) -> None:
        for step in steps:
            if step.start is not None and step.wait_from is not None:
                self._local += step.start - step.wait_from  # waiting for data
            if not step.accumulate:
                self._steps += 1

    @override
    def logging_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        local = self._local + (self._timer.take()[1] if self._timer is not None else 0.0)
        mine = [local / max(1, self._steps), _probe(trainer.strategy.root_device) if self.probe else 0.0]
        self._local, self._steps = 0.0, 0
        telemetry.contribute(
            trainer,
            self,
            telemetry.Share(mine, "gather", lambda times: self._judge(trainer, times), then=lambda: self._act(trainer)),
        )

    def _act(self, trainer: Trainer) -> None:
        """After the logging step's metrics: the restart, when due; the wait for the next batch starts after the
        reduction."""
        due = self.streaks.update(self._last_ratios) if self.action == "restart" else {}
        if due:
            self._restart(trainer, due)
        last = self.steps.last
        if last is not None:
            self.steps.finish(last)

    def _judge(self, trainer: Trainer, gathered: list[list[float]]) -> dict[str, float]:
        """Flag the slow ranks from every rank's ``[local time per step, probe]``."""
        slow: dict[int, str] = {}
        self._last_ratios = {}
        worst = 0.0
        for column, name in enumerate(("local time per step", "matmul probe")):
            values = [row[column] for row in gathered]
            median = statistics.median(values)
            if median <= 0:
                continue
            for r, value in enumerate(values):
                ratio = value / median
                worst = max(worst, ratio)
                if ratio > self.factor:
                    self.flagged.append((trainer.global_step, r, self._host(r), ratio))
                    self._last_ratios[r] = max(ratio, self._last_ratios.get(r, 0.0))
                    slow[r] = (
                        slow.get(r, "") + f"{'; ' if r in slow else ''}{name} {ratio:.2f}x the median "
                        f"({value * 1e3:.1f} ms vs {median * 1e3:.1f} ms)"
                    )
        if slow:
            rank_zero_warn(
                f"StragglerMonitor at step {trainer.global_step}: "
                + ", ".join(
                    f"rank {r} on {self._host(r)}: {why}{self._countdown(r)}" for r, why in sorted(slow.items())
                )
            )
        return {"stragglers/count": float(len(slow)), "stragglers/max_ratio": worst}

    def _host(self, rank: int) -> str:
        return self._hosts[rank] if rank < len(self._hosts) else "?"

    def _countdown(self, rank: int) -> str:
        if self.action != "restart":
            return ""
        return (
            f" (slow interval {self.streaks.count(rank) + 1} of {self.patience} in a row before a restart without it)"
        )

    def _restart(self, trainer: Trainer, due: dict[int, list[float]]) -> None:
        """Every rank: commit this step's checkpoint; rank 0: write ``stragglers/exclude.json``; all: exit."""
        who = ", ".join(f"rank {r} on {self._host(r)}" for r in due)
        rank_zero_warn(
            f"StragglerMonitor: {who} slower than {self.factor:g}x the median at {self.patience} logging intervals "
            f"in a row (step {trainer.global_step}); committing a checkpoint, then every process exits with status "
            f"{STRAGGLER_EXIT_CODE} so the job restarts without that host (docs: resilience.md#stragglers)."
        )
        path = commit_checkpoint(trainer)
        directory = Path(trainer.default_root_dir) / "stragglers"
        if trainer.is_global_zero:
            event = {
                "event": "straggler",
                "step": trainer.global_step,
                "exit_code": STRAGGLER_EXIT_CODE,
                "checkpoint": str(path),
                "factor": self.factor,
                "patience": self.patience,
                "log_every_n_steps": trainer.log_every_n_steps,
                "world_size": trainer.world_size,
                "stragglers": [{"rank": r, "host": self._host(r), "ratios": ratios} for r, ratios in due.items()],
            }
            try:
                record = record_exclusion(directory, event, [self._host(r) for r in due])
                excluded = f"{directory / 'exclude.json'} excludes {', '.join(record['exclude'])}"
            except OSError as err:  # the checkpoint is committed: exit all the same, saying what is missing
                excluded = f"cannot write {directory / 'exclude.json'} ({err}): exclude {who} by hand"
            rank_zero_warn(
                f"StragglerMonitor: checkpoint {path} committed; {excluded}. Exiting with status {STRAGGLER_EXIT_CODE}."
            )
        trainer.strategy.barrier("StragglerMonitor")  # the record is written before any process goes
        raise StragglerRestart(STRAGGLER_EXIT_CODE)
