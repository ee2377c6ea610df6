"""The hang watchdog's heartbeat, beaten by the strategy's own per-step methods.

``HangWatchdog`` (a callback, so that it works under any strategy) beats the heart of its
:class:`~lightning_scale.core.resilience.watchdog.StepWatchdog` from four per-step hooks. Lightning dispatches
every per-step hook of every callback it holds (six a step, each in a profiler context), which costs more than
the beats themselves on a CPU. Under ``HybridParallelStrategy`` the watchdog attaches to the strategy instead
(``attach_heartbeat``) and takes its hooks out of the dispatch: the strategy's methods that run at every step
anyway set the beat, with no callback call at all.

- the batch's start: ``on_train_batch_start`` (the strategy's, after the callbacks' and the module's); it also
  ends the step before, which is timed from its start to here (the data of this batch included);
- ``backward``: ``pre_backward`` (the strategy's, where Lightning's hooks see the backward start);
- ``optimizer step``: once the closure (forward and backward) returned inside ``optimizer_step``;
- ``between steps``: once the optimizer step returned (automatic optimisation), still timed;
- checkpoint saves pause the watchdog (``save_checkpoint``): a save is not a step, and the time after it up to
  the next batch is not timed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Heartbeat"]


class Heartbeat:
    """Mixed into a Lightning strategy (before its base class): the beats described in the module's docstring."""

    _heartbeat: Any = None  # a StepWatchdog, while one is attached
    _automatic = True  # the module's automatic optimisation, as the watchdog was attached

    def attach_heartbeat(self, watchdog: Any) -> None:
        """From now on the strategy beats ``watchdog``'s heart (``None``: no longer)."""
        self._heartbeat = watchdog
        self._automatic = getattr(self.lightning_module, "automatic_optimization", True)  # type: ignore[attr-defined]

    def pause_heartbeat(self) -> None:
        """Untimed from here to the next batch (a checkpoint save)."""
        if self._heartbeat is not None:
            self._heartbeat.pause()

    def on_train_batch_start(self, batch: Any, batch_idx: int, *args: Any) -> None:
        watchdog = self._heartbeat
        if watchdog is not None:
            watchdog.step_started()
        super().on_train_batch_start(batch, batch_idx, *args)  # type: ignore[misc]

    def pre_backward(self, closure_loss: Any) -> None:
        watchdog = self._heartbeat
        if watchdog is not None:
            watchdog.entered("backward")
        super().pre_backward(closure_loss)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        watchdog = self._heartbeat
        if watchdog is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]

        def closure_then_step() -> Any:
            result = closure()
            watchdog.entered("optimizer step")
            return result

        try:
            return super().optimizer_step(optimizer, closure_then_step, model, **kwargs)  # type: ignore[misc]
        finally:
            if self._automatic:  # (manual optimisation: the training step goes on)
                watchdog.entered("between steps")
