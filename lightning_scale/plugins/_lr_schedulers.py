"""Step-interval LR schedulers that stand still when the optimizer step was skipped."""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch import Trainer

__all__ = ["hold_lr_schedulers_after_skipped_steps"]

_GUARDED = "_lightning_scale_lr_guard"


def hold_lr_schedulers_after_skipped_steps(trainer: Trainer, skipped: Callable[[], bool]) -> None:
    """Make the fit loop leave the step-interval LR schedulers alone after a skipped optimizer step.

    Lightning steps them after every optimizer step it asked for (Lightning #5558): wrap the
    training epoch loop's ``_update_learning_rates`` (once per loop) so that a step-interval update
    does nothing while ``skipped()`` says the last optimizer step was skipped. Epoch-interval
    schedulers step as usual.
    """
    loop = trainer.fit_loop.epoch_loop
    if loop.__dict__.get(_GUARDED):
        return
    update = loop._update_learning_rates

    def guarded(interval: str, update_plateau_schedulers: bool) -> None:
        if interval == "step" and skipped():
            return
        update(interval=interval, update_plateau_schedulers=update_plateau_schedulers)

    loop._update_learning_rates = guarded  # type: ignore[method-assign]
    loop.__dict__[_GUARDED] = True
