"""What ``lightning-scale-train`` records of a fit besides the loggers: its loss curves and elapsed time across
resumes (:class:`ValidationRecord`, read into ``summary.json`` and ``results.json``), and a resumed run's
earlier rows of ``metrics.csv`` (:class:`CsvHistory`). The command line adds both; any script may."""

from __future__ import annotations

import os
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

__all__ = ["CsvHistory", "ValidationRecord"]


class ValidationRecord(Callback):
    """The fit's loss curves (training loss at logging steps, every validation loss) and the last
    validation loss with the step it was taken at.

    Its state goes into every checkpoint, so a resumed run's record continues the earlier attempts':
    the curves from the first step, ``prior_elapsed_s`` (the earlier attempts' time up to the checkpoint
    resumed from) and the first attempt's ``initial_val_loss``. A validation before a resumed fit is
    recorded at the step it resumes from (``resume_step``), not at 0."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.loss: float | None = None
        self.val_curve: list[tuple[int, float]] = []
        self.train_curve: list[tuple[int, float]] = []
        self.prior_elapsed_s = 0.0
        self.initial_val_loss: float | None = None
        self.resume_step: int | None = None
        self.started_at: float | None = None  # time.perf_counter() when this attempt's run started

    def _step(self, trainer: Trainer) -> int:
        return trainer.global_step if trainer.state.fn == "fit" or self.resume_step is None else self.resume_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        loss = trainer.callback_metrics.get("train/loss")
        if (
            loss is not None
            and step % max(trainer.log_every_n_steps, 1) == 0
            and (not self.train_curve or self.train_curve[-1][0] != step)
        ):
            self.train_curve.append((step, float(loss)))

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and "val/loss" in trainer.callback_metrics:
            self.step = self._step(trainer)
            self.loss = float(trainer.callback_metrics["val/loss"])
            if not self.val_curve or self.val_curve[-1] != (self.step, self.loss):
                self.val_curve.append((self.step, self.loss))

    def elapsed_s(self) -> float:
        """Every attempt's time up to now (the earlier ones up to the checkpoint this one resumed from)."""
        now = time.perf_counter()
        return self.prior_elapsed_s + (now - self.started_at if self.started_at is not None else 0.0)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "val_curve": [list(p) for p in self.val_curve],
            "train_curve": [list(p) for p in self.train_curve],
            "elapsed_s": self.elapsed_s(),
            "initial_val_loss": self.initial_val_loss,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The earlier attempts' points up to the checkpoint, then this attempt's (a validation before the
        # resumed fit, at the step it resumes from, stays).
        resumed_at = max(
            (int(s) for s, _ in state_dict.get("train_curve", []) + state_dict.get("val_curve", [])), default=-1
        )
        earlier_val = [(int(s), float(v)) for s, v in state_dict.get("val_curve", [])]
        self.val_curve = earlier_val + [p for p in self.val_curve if p[0] >= resumed_at and p not in earlier_val]
        self.train_curve = [(int(s), float(v)) for s, v in state_dict.get("train_curve", [])] + [
            p for p in self.train_curve if p[0] > resumed_at
        ]
        self.prior_elapsed_s = float(state_dict.get("elapsed_s") or 0.0)
        if state_dict.get("initial_val_loss") is not None:
            self.initial_val_loss = float(state_dict["initial_val_loss"])


class CsvHistory(Callback):
    """Keep a resumed run's earlier rows in ``CSVLogger``'s ``metrics.csv``.

    Lightning's CSV writer deletes an existing ``metrics.csv`` when it starts, so a run resumed in its
    own directory kept only the rows of its last attempt. The file's rows are read when this callback is
    made (before any writer starts); when training starts, those before the step it resumes from are
    put back ahead of the new ones (global rank 0, where the loggers write)."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        self._earlier: list[dict[str, str]] = []
        path = os.path.join(logger.log_dir, "metrics.csv")
        if os.path.isfile(path):
            import csv

            with open(path, newline="") as f:
                self._earlier = list(csv.DictReader(f))

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._earlier or not trainer.is_global_zero:
            return
        import csv

        start = trainer.global_step
        keep = [r for r in self._earlier if r.get("step", "").isdigit() and int(r["step"]) < start]
        self._earlier = []
        if not keep:
            return
        writer = self.logger.experiment  # Lightning's _ExperimentWriter (its file deleted when it started)
        writer.save()  # what this run logged so far (its validation before training)
        path = writer.metrics_file_path
        current: list[dict[str, str]] = []
        if os.path.isfile(path):
            with open(path, newline="") as f:
                current = list(csv.DictReader(f))
        keys = list(dict.fromkeys(k for row in (*keep, *current) for k in row))
        with open(path, "w", newline="") as f:
            out = csv.DictWriter(f, fieldnames=keys)
            out.writeheader()
            out.writerows([*keep, *current])
        writer.metrics_keys = keys  # later saves append under this header (or widen it)
