"""A quiet CPU Trainer for tests: no logger, checkpoints, progress bar or model summary unless asked."""

from __future__ import annotations

import os
import time
from typing import Any

from lightning.pytorch import Callback, Trainer

__all__ = ["SlowSteps", "fit_error", "quiet_trainer"]


def quiet_trainer(**overrides: Any) -> Trainer:
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "limit_val_batches": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "log_every_n_steps": 1,  # tests read every step's metrics
    }
    return Trainer(**(kwargs | overrides))


def fit_error(trainer: Trainer, module: Any, **fit_kwargs: Any) -> str:
    """The ``ValueError`` message ``trainer.fit`` raises, or ``"no error"``."""
    try:
        trainer.fit(module, **fit_kwargs)
    except ValueError as err:
        return str(err)
    return "no error"


class SlowSteps(Callback):
    """Sleeps ``seconds`` after every training step past ``after_step`` while the environment variable
    :attr:`ENV` is set (in the process that trains): a run a test kills mid-way (after a checkpoint at
    ``after_step``) cannot reach its last step before the kill lands, however late a loaded machine
    schedules the test, while other runs of the same command (the same sweep) go at full speed. Added to
    a CLI run with ``+callbacks.slow._target_=helpers.lightning.SlowSteps`` (``tests/`` on ``PYTHONPATH``)."""

    ENV = "LIGHTNING_SCALE_TEST_SLOW_STEPS"

    def __init__(self, after_step: int = 5, seconds: float = 0.2) -> None:
        self.after_step, self.seconds = after_step, seconds

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step > self.after_step and os.environ.get(self.ENV):
            time.sleep(self.seconds)
