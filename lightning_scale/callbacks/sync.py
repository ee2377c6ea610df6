"""``SyncMonitor``: what the data-parallel exchange sends (every step's all-reduce, Local SGD, DiLoCo)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lightning_scale.callbacks import _telemetry as telemetry

__all__ = ["SYNC_METRICS", "SyncMonitor"]

SYNC_METRICS = ("train/sync/bytes_per_step", "train/sync/exchanges_per_step", "train/sync/bytes_total")
"""The metrics logged (see :class:`SyncMonitor`)."""

_COUNTERS = ("bytes_sent", "exchanges", "blocked_s")
"""The strategy's cumulative counters (``sync_stats()``) kept across resumes."""


class SyncMonitor(telemetry.SharedTelemetry):
    """Log what ``HybridParallelStrategy``'s data-parallel exchange sent, at Lightning's logging steps, from
    the strategy's ``sync_stats()`` (each process's own counters since the fit started):

    - ``train/sync/bytes_per_step``: bytes one process sent per optimizer step, over the steps since the last
      logging step; the mean over the processes. ``every_step``: the gradient all-reduce's ring bytes,
      2 (dp - 1) / dp x the gradient's; ``local_sgd``/``diloco``: an exchange's bytes / H;
    - ``train/sync/exchanges_per_step``: all-reduce rounds of the exchange per optimizer step, the same mean;
    - ``train/sync/bytes_total``: bytes one process sent since the run started (earlier attempts of a resumed
      run included); **per process**, the mean over the processes, not their sum: the figure that compares
      with plain DDP's (each of its ranks sends the ring's bytes).

    A resumed run goes on from the checkpoint's totals: this callback's own (in its checkpoint state), or the
    strategy's where it counts on from the checkpoint itself (its counters are not 0 when training starts).
    The time the loop waited on the exchange is ``StepTimeBreakdown``'s ``train/step_time/sync``. Three numbers
    in the logging step's one all-reduce (shared with the other telemetry callbacks); nothing per step. Under a
    strategy without ``sync_stats()`` (Lightning's own) nothing is logged.

    For a study's report (``lightning-scale-report``'s validation loss against bytes and time), it notes at the
    fit's start and end and at each validation inside ``fit`` the step, the training seconds so far (validation
    excluded) and the bytes sent; at the end of training one all-reduce (on every process) turns them and the
    totals into means over the processes: :attr:`summary`, which ``lightning-scale-train`` writes into
    ``results.json`` (``sync``). The totals and the notes are in checkpoints and continue on resume.
    """

    def __init__(self) -> None:
        super().__init__()
        self._read: Callable[[], Mapping[str, Any]] | None = None  # the strategy's sync_stats
        self._prior = dict.fromkeys(_COUNTERS, 0.0)  # earlier attempts', from the checkpoint resumed
        self._prior_train_s = 0.0
        self._curve: list[tuple[int, float, float]] = []  # (step, training seconds, bytes sent): this process's
        self._origin = 0.0
        self._last = (0, 0.0, 0.0)  # (global step, bytes sent, exchanges) at the last logging step, this fit's
        self.summary: dict[str, Any] | None = None
        """After training (every process): ``mode``, ``every``, ``steps``, ``bytes_sent``, ``exchanges``,
        ``blocked_s``, ``train_s`` and ``bytes_per_step`` since the run started, and ``curve``, rows of
        ``[step, train_s, bytes_sent]``; the numbers are means over the processes. None without ``sync_stats()``."""

    # ------------------------------------------------------------------ the fit

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read = telemetry.sync_stats_reader(trainer)  # alike on every process: they reduce alike
        self.summary = None
        self._origin = self._clock.now()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._origin = self._clock.now()
        self._last = (trainer.global_step, 0.0, 0.0)
        if self._read is None:
            return
        start = self._read()  # the strategy restored: its checkpoint is read by now
        if any(float(start.get(k, 0.0)) for k in _COUNTERS):
            # Nothing was exchanged in this fit yet: a strategy that counts on from the checkpoint it resumed
            # (HybridParallelStrategy's periodic modes) already holds the earlier attempts' totals.
            self._prior = dict.fromkeys(_COUNTERS, 0.0)
        self._last = (trainer.global_step, float(start.get("bytes_sent", 0.0)), float(start.get("exchanges", 0)))
        self._note(trainer.global_step, self._stats(), self._prior_train_s)

    @override
    def needs_steps(self) -> bool:
        return False

    def _stats(self) -> dict[str, Any]:
        """This process's counters since the run started (the strategy's since the fit's, plus earlier attempts')."""
        stats = dict(self._read() if self._read is not None else {})
        for key in _COUNTERS:
            stats[key] = self._prior[key] + float(stats.get(key, 0.0))
        return stats

    def _train_s(self) -> float:
        return self._prior_train_s + self._clock.now() - self._origin

    def _note(self, step: int, stats: dict[str, Any], train_s: float | None = None) -> None:
        point = (step, self._train_s() if train_s is None else train_s, stats["bytes_sent"])
        if self._curve and self._curve[-1][0] == step:
            self._curve[-1] = point
        elif not self._curve or self._curve[-1][0] < step:
            self._curve.append(point)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_start(trainer, pl_module)
        if self._read is not None and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._note(trainer.global_step, self._stats())

    # ------------------------------------------------------------------ logging steps

    @override
    def logging_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Every process takes part in the step's reduction, with no numbers when there is nothing to log.
        if self._read is None:
            telemetry.contribute(trainer, self, telemetry.Share((), "sum", lambda _: {}))
            return
        stats = self._read()
        sent, exchanges = float(stats.get("bytes_sent", 0.0)), float(stats.get("exchanges", 0))
        step, last_sent, last_exchanges = self._last
        steps = trainer.global_step - step
        self._last = (trainer.global_step, sent, exchanges)
        window = [telemetry.since(sent, last_sent), telemetry.since(exchanges, last_exchanges)]
        total = self._prior["bytes_sent"] + sent
        telemetry.contribute(
            trainer, self, telemetry.Share([*window, total], "sum", lambda sums: self._metrics(trainer, sums, steps))
        )

    def _metrics(self, trainer: Trainer, sums: list[float], steps: int) -> dict[str, float]:
        sent, exchanges, total = (v / trainer.world_size for v in sums)
        out = {"train/sync/bytes_total": total}
        if steps > 0:
            out |= {"train/sync/bytes_per_step": sent / steps, "train/sync/exchanges_per_step": exchanges / steps}
        return out

    # ------------------------------------------------------------------ the end

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self._read is None:
            return
        stats, seconds_now = self._stats(), self._train_s()
        self._note(trainer.global_step, stats, seconds_now)
        curve = self._curve
        mine = [*(float(stats[k]) for k in _COUNTERS), seconds_now, *(s for _, s, _ in curve)]
        mine += [b for _, _, b in curve]
        # One all-reduce on every process (the same count of numbers: validation runs at the same steps on all).
        mean = [v / trainer.world_size for v in telemetry.reduce_sum(trainer, mine)]
        sent, exchanges, blocked, train_s = mean[:4]
        seconds, sent_at = mean[4 : 4 + len(curve)], mean[4 + len(curve) :]
        steps = trainer.global_step
        self.summary = {
            "mode": stats.get("mode"),
            "every": stats.get("every"),
            "steps": steps,
            "bytes_sent": sent,
            "exchanges": exchanges,
            "blocked_s": blocked,
            "train_s": train_s,
            "bytes_per_step": sent / steps if steps else None,
            "curve": [[step, s, b] for (step, _, _), s, b in zip(curve, seconds, sent_at, strict=True)],
        }

    # ------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._read is None:
            return {}
        stats = self._stats()
        return {
            **{k: float(stats[k]) for k in _COUNTERS},
            "train_s": self._train_s(),
            "curve": [list(p) for p in self._curve],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._prior = {k: float(state_dict.get(k) or 0.0) for k in _COUNTERS}
        self._prior_train_s = float(state_dict.get("train_s") or 0.0)
        self._curve = [(int(s), float(t), float(b)) for s, t, b in state_dict.get("curve") or []]
