"""``GoodputMonitor``: the goodput ledger of a run across its restarts, and its ``goodput/...`` metrics."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lightning_scale.callbacks import _telemetry as telemetry
from lightning_scale.core.checkpoint.format import CheckpointCorruptError, read_manifest
from lightning_scale.core.checks import check_positive_number
from lightning_scale.core.resilience.goodput import GoodputSummary, Ledger, read_ledger, summarize
from lightning_scale.core.resilience.goodput_ledger import ProgressWriter, append_event, process_start_time
from lightning_scale.plugins.checkpoint_io import restarted

__all__ = ["GOODPUT_METRICS", "GoodputMonitor"]

GOODPUT_METRICS = {
    "goodput/goodput": "goodput",
    "goodput/productive_s": "productive_s",
    "goodput/lost_s": "lost_s",
    "goodput/checkpoint_s": "checkpoint_s",
    "goodput/startup_s": "startup_s",
    "goodput/restart_s": "restart_s",
    "goodput/rendezvous_s": "rendezvous_s",
    "goodput/hang_detection_s": "hang_detection_s",
    "goodput/mttr_s": "mttr_s",
    "goodput/interruptions": "interruptions",
}
"""The metrics logged, each a :class:`~lightning_scale.core.resilience.goodput.GoodputSummary` field."""

_fits_in_process = 0  # the first fit of a process counts its start-up from the process's start


class GoodputMonitor(telemetry.SharedTelemetry):
    """Record where the run's wall time goes, across restarts, and log ``goodput/...`` at logging steps.

    Global rank 0 appends the attempt's events to ``<dirpath>/goodput/events.jsonl`` (its process start and the
    checkpoint it resumed, its first step, each checkpoint save with the seconds it blocked training, its end)
    and a thread of its own rewrites ``goodput/progress-<attempt>.json`` every ``progress_s`` seconds (the last
    time it was alive, and its step, which the thread reads itself): all a SIGKILLed attempt leaves. The other
    ranks do nothing. Per training step: nothing but the logging-step check; no collective, host sync or file
    write (the metrics are published with the
    other telemetry callbacks' at logging steps, and add no numbers to their reduction).
    :func:`lightning_scale.core.resilience.goodput.read_ledger` and ``summarize`` turn the ledger (with the hang
    watchdog's ``hang/events.jsonl``) into productive, lost, checkpoint, start-up, restart, rendezvous and hang
    detection seconds, goodput and the mean time to recover; :attr:`summary` holds them after the fit. An attempt
    starts when its process started (the first fit of a process) or when the monitor was made (a later fit in
    the same process, e.g. the next job of an in-process sweep).

    Args:
        dirpath: the run directory (default: the Trainer's ``default_root_dir``; ``lightning-scale-train``'s run
            directory). Every attempt of a run must use the same one.
        progress_s: seconds between two writes of the progress file: how well the last sign of life of a killed
            attempt is known (lost work may be short by up to this much, which restart time then holds).
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, *, progress_s: float = 1.0) -> None:
        super().__init__()
        self.dirpath = dirpath
        self.progress_s = check_positive_number(
            "progress_s", progress_s, unit="seconds", fix="It is how often the attempt's last sign of life is written."
        )
        self._created = time.time()
        self._root: Path | None = None
        self._ledger = Ledger()
        self._attempt: str | None = None
        self._progress: ProgressWriter | None = None
        self._first_pending = False
        self.summary: GoodputSummary | None = None
        """Where the run's time went, as of the end of this fit (global rank 0; None elsewhere)."""

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        global _fits_in_process
        self._stop()
        if not trainer.is_global_zero:
            return
        self._root = Path(self.dirpath if self.dirpath is not None else trainer.default_root_dir)
        self._ledger = read_ledger(self._root)
        started = process_start_time() if _fits_in_process == 0 else self._created
        _fits_in_process += 1
        resumed, commit = _resumed(trainer)
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self._attempt = f"{os.getpid()}-{time.time_ns() // 1_000_000}"
        self._event(
            "start",
            time=started,
            step=trainer.global_step,
            relaunch=restarted(),
            resumed_step=trainer.global_step if resumed or trainer.global_step > 0 else None,
            resumed_commit=commit,
            restart_count=restarts,
            pid=os.getpid(),
        )
        # The writer's thread reads the step itself: nothing per training step here.
        self._progress = ProgressWriter(
            self._root, self._attempt, step=lambda: trainer.global_step, period_s=self.progress_s
        )
        self._progress.start()
        self._first_pending = True
        self._cleanups.append(telemetry.on_checkpoint_saved(trainer, lambda seconds: self._saved(trainer, seconds)))

    @override
    def needs_steps(self) -> bool:
        return self._first_pending  # the fit's first batch, for its "first_step" event; then nothing

    @override
    def fold_steps(self, trainer: Trainer, pl_module: LightningModule, steps: Sequence[telemetry.Step]) -> None:
        # A group folds the fit's first batch at its end: the event is written then, with its start's time.
        if self._first_pending and steps:
            self._first_pending = False
            first = steps[0]
            self._event(
                "first_step",
                time=first.wall if first.wall is not None else time.time(),
                step=first.global_step if first.global_step is not None else trainer.global_step,
            )

    @override
    def logging_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Published with the other telemetry (every process takes part).
        telemetry.contribute(trainer, self, telemetry.Share((), "sum", lambda _: self._metrics()))

    def _metrics(self) -> dict[str, float]:
        summary = summarize(self._ledger.attempts, now=time.time()) if self._progress is not None else None
        if summary is None:
            return {}
        values = {name: getattr(summary, field) for name, field in GOODPUT_METRICS.items()}
        return {k: v for k, v in values.items() if v is not None}

    def _saved(self, trainer: Trainer, seconds: float) -> None:
        if self._progress is not None:
            self._event("checkpoint", time=time.time(), step=trainer.global_step, blocking_s=max(0.0, seconds))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end(trainer, "completed")

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._end(trainer, "interrupted")  # preempted (after its checkpoint), or failed
        super().on_exception(trainer, pl_module, exception)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()

    def _end(self, trainer: Trainer, status: str) -> None:
        if self._progress is None:
            return
        self._event("end", time=time.time(), step=trainer.global_step, status=status)
        self._stop()
        self.summary = summarize(self._ledger.attempts)

    def _event(self, kind: str, **fields: Any) -> None:
        assert self._root is not None and self._attempt is not None
        event = {"event": kind, "attempt": self._attempt, **fields}
        try:
            self._ledger.add(append_event(self._root, event))
        except OSError as err:  # the ledger is a record, not a reason to stop training
            self._ledger.problems.append(f"cannot append to the goodput ledger in {self._root}: {err}")

    def _stop(self) -> None:
        self._run_cleanups()
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.stop()


def _resumed(trainer: Trainer) -> tuple[bool, float | None]:
    """Whether the fit loaded a checkpoint, and when that checkpoint was committed (its manifest's time stamp; a
    file's modification time), when known."""
    path = getattr(trainer.strategy.checkpoint_io, "resumed_from", None) or trainer.ckpt_path
    if path is None or not os.path.exists(str(path)):
        return False, None
    if os.path.isdir(str(path)):
        try:
            created = read_manifest(path).get("created_unix_s")
        except CheckpointCorruptError:
            return True, None
        ok = isinstance(created, (int, float)) and not isinstance(created, bool) and created >= 0
        return True, float(created) if ok else None
    return True, os.path.getmtime(str(path))
