"""Step-interval LR schedulers that stand still when the optimizer step was skipped."""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch import Trainer

from lightning_scale._lightning_compat import wrap_update_learning_rates

__all__ = ["hold_lr_schedulers_after_skipped_steps"]


def hold_lr_schedulers_after_skipped_steps(trainer: Trainer, skipped: Callable[[], bool]) -> None:
    """Make the fit loop leave the step-interval LR schedulers alone after a skipped optimizer step.

    Lightning steps them after every optimizer step it asked for (Lightning #5558): the training
    epoch loop's LR update is wrapped (once per loop) so that a step-interval update does nothing
    while ``skipped()`` says the last optimizer step was skipped. Epoch-interval schedulers step as
    usual.
    """
    wrap_update_learning_rates(trainer, lambda interval: interval == "step" and skipped())
