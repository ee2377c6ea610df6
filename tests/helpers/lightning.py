"""A quiet CPU Trainer for tests: no logger, checkpoints, progress bar or model summary unless asked."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer

__all__ = ["fit_error", "quiet_trainer"]


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
