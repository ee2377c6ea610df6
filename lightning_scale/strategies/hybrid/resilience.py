"""The strategy's hang watchdog and preemption handling, called from ``HybridParallelStrategy``'s own methods.

No callback runs for either under the strategy: Lightning dispatches every per-step hook of every callback it
holds (six a step, each in a profiler context), which costs more than the beats themselves on a CPU, so the
strategy's methods that run at every step anyway set them. The mechanisms are
:class:`~lightning_scale.core.resilience.watchdog.StepWatchdog` and
:mod:`~lightning_scale.core.resilience.preemption`; the callbacks for other strategies
(:class:`~lightning_scale.callbacks.HangWatchdog`, :class:`~lightning_scale.callbacks.PreemptionCheckpoint`)
are built on the same.

The heartbeat, from the strategy's methods:

- the batch's start: ``on_train_batch_start`` (the strategy's, after the callbacks' and the module's); it also
  ends the step before, which is timed from its start to here (the data of this batch included);
- ``backward``: ``pre_backward``;
- ``optimizer step``: once the closure (forward and backward) returned inside ``optimizer_step``;
- ``between steps``: once the optimizer step returned (automatic optimisation), still timed (a collective in a
  callback's batch end, the next batch's data).

Not timed, because a healthy job spends long there and none of it is a step:

- a checkpoint, from the start of the Trainer's dump (``lightning_module_state_dict``, the first thing
  ``Trainer.save_checkpoint`` asks the strategy for, before every ``on_save_checkpoint`` hook) through the save
  and its wait for an async save in flight, to the next batch;
- validation, the whole of it (``Trainer.validating``: set before the loop builds its data, runs the callbacks'
  and the module's hooks, and cleared after), and the sanity check, which runs before the watchdog starts;
- the end of an epoch (from the end of its last batch to the next epoch's start: ``on_train_epoch_end`` hooks,
  a logger's flush, the epoch's end of-epoch metrics);
- an exception's handling: the watchdog stops at the strategy's ``on_exception``, before Lightning's teardown.

The watchdog's thread reads the Trainer's state for the last two (no cost to a step); a step that goes on
afterwards is timed from the last look that saw it.

Preemption (SIGTERM, SIGUSR1; ``ShardedCheckpointIO(preemption=False)``: off): the handlers only set a flag.
Every rank all-reduces it once per optimizer step, inside ``optimizer_step`` once the step returned (timed
like the step: a rank that never reaches it is named by the watchdog); when one rank was signalled, all of
them stop at the next step boundary: the next batch's ``batch_to_device`` (the previous batch ended, its
checkpoint callbacks ran), the start of a validation in the fit, or the fit's end. There a checkpoint is
committed, SLURM requeues, and :class:`~lightning_scale.core.resilience.preemption.Preempted` ends the
process with :data:`~lightning_scale.plugins.PREEMPTION_EXIT_CODE`. That all-reduce takes the place of
Lightning's own per-batch SIGTERM broadcast, which is idle while the flag's handler owns SIGTERM.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lightning_scale._lightning_compat as lc
from lightning_scale.core.resilience.preemption import Preempted, SignalFlag, anyone_signalled
from lightning_scale.core.resilience.watchdog import HangTimeout, StepWatchdog, hang_timeout_policy
from lightning_scale.plugins._checkpoint_commit import commit_checkpoint, requeue
from lightning_scale.plugins.checkpoint_io import PREEMPTION_EXIT_CODE

__all__ = ["Resilience", "not_a_step"]

_PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")


def not_a_step(trainer: Trainer) -> Callable[[], bool]:
    """For the watchdog's thread: whether ``trainer`` is now in something that is not a training step (a
    validation, the end of an epoch). Attribute reads only."""

    def check() -> bool:
        # From the epoch loop's end (processed) to the next epoch's start (started): the epoch's end hooks.
        epochs = trainer.fit_loop.epoch_progress.current  # public attributes of the fit loop
        return trainer.validating or trainer.sanity_checking or epochs.processed >= epochs.started

    return check


class Resilience:
    """What ``HybridParallelStrategy`` does against hangs and preemption (see the module's docstring).

    Args:
        hang_timeout: the strategy's option (:func:`~lightning_scale.core.resilience.hang_timeout_policy`).
    """

    def __init__(self, hang_timeout: Any) -> None:
        self.policy = hang_timeout_policy(hang_timeout)
        self.watchdog: StepWatchdog | None = None  # while a fit runs, when the watchdog is on
        self.preemption: SignalFlag | None = None  # while a fit runs, when preemption is handled
        self._trainer: Trainer | None = None
        self._automatic = True
        self._stop_agreed = False
        self._idled_loop: Any = None

    # ------------------------------------------------------------------ a fit's start and end

    def start(self, trainer: Trainer, *, preemption: bool) -> None:
        """At the fit's training start (the strategy's ``on_train_start``): the watchdog's thread, the signals'
        handlers; ``preemption``: whether to handle the signals (the checkpoint IO's option)."""
        self.stop()
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._trainer, self._stop_agreed = trainer, False
        self._automatic = trainer.lightning_module.automatic_optimization
        if self.policy is not None:
            self._start_watchdog(trainer, self.policy)
        if preemption:
            self.preemption = SignalFlag(_PREEMPTION_SIGNALS, owner="HybridParallelStrategy")
            self.preemption.install()  # after Lightning registered its own SIGTERM handler
            loop = trainer.fit_loop.epoch_loop
            if "SIGTERM" in self.preemption.signals and lc.idle_sigterm_broadcast(loop):
                self._idled_loop = loop

    def stop(self) -> None:
        """The fit ended, failed or was torn down: the watchdog's thread ends, the signals' handlers are put back."""
        self._stop_watchdog()
        flag, self.preemption = self.preemption, None
        if flag is not None:
            flag.restore()
        loop, self._idled_loop = self._idled_loop, None
        if loop is not None:
            lc.restore_sigterm_broadcast(loop)
        self._trainer = None

    def switch_watchdog(self, on: bool) -> None:
        """Within the running fit, stop the watchdog (``on=False``: its thread ends and the beats do nothing) or start
        a new one as :meth:`start` does (``on=True``; nothing when ``hang_timeout`` turned it off or one runs), the
        preemption handling left as it is. ``benchmarks/resilience.py`` switches it every few steps to measure what
        it costs a step."""
        if not on:
            self._stop_watchdog()
        elif self.watchdog is None and self.policy is not None and self._trainer is not None:
            self._start_watchdog(self._trainer, self.policy)

    def _start_watchdog(self, trainer: Trainer, policy: HangTimeout) -> None:
        self.watchdog = StepWatchdog.for_process(
            policy,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            directory=Path(trainer.default_root_dir) / "hang",
            global_step=lambda: trainer.global_step,
            steps_before=trainer.global_step,  # a resumed run (or a restarted watchdog) gets no second warm-up
            untimed=not_a_step(trainer),
        )
        self.watchdog.start()

    def _stop_watchdog(self) -> None:
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.stop()

    # ------------------------------------------------------------------ the heartbeat

    def step_started(self) -> None:
        if (watchdog := self.watchdog) is not None:
            watchdog.step_started()

    def backward_started(self) -> None:
        if (watchdog := self.watchdog) is not None:
            watchdog.entered("backward")

    def pause(self) -> None:
        """Untimed from here to the next batch (a checkpoint's dump and save)."""
        if (watchdog := self.watchdog) is not None:
            watchdog.pause()

    def optimizer_step(self, step: Callable[[Callable[[], Any]], Any], closure: Callable[[], Any]) -> Any:
        """``step(closure)`` (the base strategy's optimizer step), with the phases beaten and, after it, the
        preemption flag agreed."""
        watchdog = self.watchdog
        if watchdog is None and self.preemption is None:
            return step(closure)

        def closure_then_step() -> Any:
            result = closure()
            if watchdog is not None:
                watchdog.entered("optimizer step")
            return result

        try:
            result = step(closure_then_step if watchdog is not None else closure)
            if self.preemption is not None and self._trainer is not None:
                received = self.preemption.received is not None
                self._stop_agreed = anyone_signalled(received, self._trainer.strategy.root_device)
            return result
        finally:
            if watchdog is not None and self._automatic:  # (manual optimisation: the training step goes on)
                watchdog.entered("between steps")

    # ------------------------------------------------------------------ preemption: the step boundary

    def at_step_boundary(self) -> None:
        """Where the strategy stands between two steps: when the ranks agreed to stop, commit a checkpoint of the
        step reached and raise :class:`Preempted` on every rank (every rank reaches the same boundary)."""
        trainer = self._trainer
        if not self._stop_agreed or trainer is None:
            return
        self._stop_agreed = False
        self.pause()
        rank_zero_info(f"Preemption signal received: saving a checkpoint at step {trainer.global_step}, then exiting.")
        path = commit_checkpoint(trainer)
        rank_zero_info(f"Preemption checkpoint committed: {path}.")
        requeue(trainer)
        raise Preempted(PREEMPTION_EXIT_CODE)

    @property
    def running(self) -> bool:
        """A fit's training runs with this in charge (between ``start`` and ``stop``)."""
        return self._trainer is not None
