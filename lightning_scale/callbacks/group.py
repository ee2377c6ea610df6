"""``CallbackGroup``: several callbacks that Lightning dispatches as one."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import (
    BasePredictionWriter,
    BatchSizeFinder,
    Checkpoint,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateFinder,
    ModelSummary,
    ProgressBar,
    Timer,
)
from lightning.pytorch.utilities import rank_zero_warn

from lightning_scale._lightning_hooks import STEP_HOOKS, restore_hooks, skip_hooks
from lightning_scale.callbacks._telemetry import CallbackSet, SharedTelemetry, StepRecorder, each_callback
from lightning_scale.callbacks.console import ConsoleLogger
from lightning_scale.callbacks.hang_watchdog import HangWatchdog
from lightning_scale.callbacks.preemption import PreemptionCheckpoint

__all__ = ["CallbackGroup", "each_callback", "group_callbacks"]

HOOKS = tuple(sorted(name for name in vars(Callback) if name in ("setup", "teardown") or name.startswith("on_")))
"""Every hook Lightning calls on a callback."""

RECORDED_HOOKS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")
"""The per-step hooks whose work the group's recorder does for its shared members."""

FOLD_BEFORE = frozenset({"on_train_epoch_end", "on_train_end", "on_fit_end", "on_exception", "on_save_checkpoint"})
"""Hooks after which the shared members may read their sums outside a logging step (besides ``state_dict``,
validation's start and ``teardown``): the steps recorded so far are folded first."""

_MOST_PENDING = 64
"""Steps recorded before the members fold them even without a logging step (the records are not kept long)."""

APART = (
    Checkpoint,
    EarlyStopping,
    ProgressBar,
    ModelSummary,
    Timer,
    BatchSizeFinder,
    LearningRateFinder,
    BasePredictionWriter,
    GradientAccumulationScheduler,
    PreemptionCheckpoint,
    HangWatchdog,
)
"""Callbacks that Lightning or this package find by type in ``trainer.callbacks`` (or call at times of their own):
they cannot be in a group."""


class CallbackGroup(CallbackSet):
    """Callbacks that Lightning dispatches as one: each hook of the group calls the members that define it, in
    order, and no other. Behaves as the members would in ``Trainer(callbacks=[...])``, at less cost per step:
    Lightning calls every hook of every callback it holds (a no-op one included) with bookkeeping of its own,
    about a microsecond each; eight callbacks make some fifty such calls a training step, a group of them six,
    fewer still as the group's per-step hooks that no member needs are taken out of the dispatch.
    ``lightning-scale-train`` groups the callbacks of its ``callbacks`` config this way (but the checkpoint one).

    The telemetry members (``Throughput``, ``CostMonitor``, ``StepTimeBreakdown``, ``SyncMonitor``,
    ``StragglerMonitor``, ``GoodputMonitor``, ``MemoryMonitor``) get no per-step hook: the group records each step once
    (:class:`~lightning_scale.callbacks._steps.StepRecorder`) and they fold the records into their sums at
    logging steps (and before their state is read: validation, checkpoints, the fit's end). They report the
    same figures as apart. One with its own ``batch_shape`` or ``token_count`` gets its hooks as apart.

    Checkpoints keep each member's state under the member's own ``state_key``, inside the group's entry;
    a checkpoint written with the members apart (directly in ``trainer.callbacks``) loads into them too.
    :func:`each_callback` lists a Trainer's callbacks with every group's members in its place. The group
    keeps its place among the Trainer's callbacks; a :class:`ConsoleLogger` member runs after the other
    members, so its lines show what they published at the step (alone, a console moves behind every other
    callback: keep it apart to print what callbacks outside the group publish).

    Args:
        callbacks: the members. Not allowed, with a ``TypeError``: what Lightning or this package find by type
            (checkpoint, early-stopping, progress-bar, summary, timer, finder, prediction-writer and
            gradient-accumulation callbacks, ``PreemptionCheckpoint``, ``HangWatchdog``); pass those to the
            Trainer apart. A group among them is flattened into this one.
        name: told apart in checkpoints (``state_key``) from another group of the same Trainer.
    """

    def __init__(self, callbacks: Iterable[Callback], *, name: str = "telemetry") -> None:
        members: list[Callback] = []
        for callback in callbacks:
            if isinstance(callback, CallbackGroup):
                members += callback.callbacks
            elif not isinstance(callback, Callback):
                raise TypeError(
                    f"CallbackGroup takes Lightning callbacks; got {callback!r} ({type(callback).__name__})."
                )
            elif isinstance(callback, APART):
                raise TypeError(
                    f"{type(callback).__name__} cannot be in a CallbackGroup: Lightning or lightning-scale look it up by "
                    "type in trainer.callbacks, where a group hides it. Pass it to Trainer(callbacks=[...]) beside the group."
                )
            else:
                members.append(callback)
        keys = [m.state_key for m in members if _stateful(m)]
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            raise ValueError(
                f"CallbackGroup: more than one member keeps its state under {repeated}; a checkpoint could not tell "
                "them apart. Give them distinct state keys, or keep one of each."
            )
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"CallbackGroup(name={name!r}) must be a non-empty string: it names the group's checkpoint state."
            )
        # A console prints what the others published at the step: it goes last.
        self.callbacks = [m for m in members if not isinstance(m, ConsoleLogger)] + [
            m for m in members if isinstance(m, ConsoleLogger)
        ]
        self.name = name
        self._recorder = StepRecorder()
        self._context: tuple[Trainer, LightningModule] | None = None
        self._index()

    def _index(self, trainer: Trainer | None = None) -> None:
        """Each hook's members' methods, read now (an instance may have replaced one, or taken one out of the
        dispatch), and the members whose steps the group records (at set-up, with the ``trainer``)."""
        shared = [m for m in self.callbacks if isinstance(m, SharedTelemetry) and m.share_steps()] if trainer else []
        for member in self.callbacks:
            if isinstance(member, SharedTelemetry):
                member._shared = self._recorder if member in shared else None

        def calls(member: Callback, hook: str) -> bool:
            if member in shared and hook in RECORDED_HOOKS:
                return False
            return _defines(member, hook)

        self._hooks: dict[str, list[Any]] = {
            hook: [getattr(m, hook) for m in self.callbacks if calls(m, hook)] for hook in HOOKS
        }
        # At a logging step's end, in the members' order: each shared member's logging step, the others' batch end.
        self._logging_end = [
            (m.logging_step, True) if m in shared else (m.on_train_batch_end, False)
            for m in self.callbacks
            if m in shared or calls(m, "on_train_batch_end")
        ]
        self._shared = shared
        self._pending: list[Any] = []
        if shared and trainer is not None:
            options = [m.record_options(trainer) for m in shared]
            self._recorder.reset(
                cuda=any(o["cuda"] for o in options),
                sizes=any(o["sizes"] for o in options),
                reads={r for o in options for r in o["reads"]},
            )

    @property
    def state_key(self) -> str:
        return f"{type(self).__qualname__}[{self.name}]"

    @property
    def needs_model_flops(self) -> bool:
        """Whether a member asks the strategy to count the model's FLOPs (``Throughput``)."""
        return any(getattr(m, "needs_model_flops", False) for m in self.callbacks)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for callback in (self, *self.callbacks):  # what an earlier fit took out of Lightning's dispatch
            restore_hooks(callback)
        self._index(trainer)
        self._context = (trainer, pl_module)
        for member in self.callbacks:  # what Lightning gives every callback it holds
            member.log, member.log_dict = pl_module.log, pl_module.log_dict  # type: ignore[method-assign]
        for method in self._hooks["setup"]:
            method(trainer, pl_module, stage)
        # Again: a member's set-up may take a hook out of the dispatch (GradNormMonitor's, when the precision
        # plugin logs the norm). A per-step hook with nothing to do is not dispatched at all.
        self._index(trainer)
        skip_hooks(self, [h for h in STEP_HOOKS if not self._hooks[h] and not (self._shared and h in RECORDED_HOOKS)])

    # ------------------------------------------------------------------ the steps

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._shared:
            self._recorder.batch_start(trainer, batch)
        for method in self._hooks["on_train_batch_start"]:
            method(trainer, pl_module, batch, batch_idx)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._shared:
            self._recorder.optimizer()
        for method in self._hooks["on_before_optimizer_step"]:
            method(trainer, pl_module, optimizer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._shared:
            for method in self._hooks["on_train_batch_end"]:
                method(trainer, pl_module, outputs, batch, batch_idx)
            return
        step = self._recorder.batch_end(trainer)
        pending = self._pending
        pending.append(step)
        if step.log:
            self._fold()
            for method, shared in self._logging_end:
                if shared:
                    method(trainer, pl_module)
                else:
                    method(trainer, pl_module, outputs, batch, batch_idx)
        else:
            if step.index == 0 or len(pending) >= _MOST_PENDING:  # the fit's first batch: its start is on record
                self._fold()
            for method in self._hooks["on_train_batch_end"]:
                method(trainer, pl_module, outputs, batch, batch_idx)
        self._recorder.finish(step)

    def _fold(self) -> None:
        """The steps recorded since the last fold, into every shared member's sums."""
        steps, self._pending = self._pending, []
        if steps and self._context is not None:
            trainer, pl_module = self._context
            for member in self._shared:
                member.fold_steps(trainer, pl_module, steps)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fold()
        if self._shared:
            self._recorder.pause()
        for method in self._hooks["on_validation_start"]:
            method(trainer, pl_module)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._shared:
            self._recorder.resume()
        for method in self._hooks["on_validation_end"]:
            method(trainer, pl_module)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._fold()
        for method in self._hooks["teardown"]:
            method(trainer, pl_module, stage)
        self._context = None

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        self._fold()  # the members' state up to the last step (e.g. the cost of the steps since the logging step)
        states = {m.state_key: m.state_dict() for m in self.callbacks}
        return {key: state for key, state in states.items() if state}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        by_key = {m.state_key: m for m in self.callbacks}
        for key, state in states.items():
            if key in by_key and state:
                by_key[key].load_state_dict(copy.deepcopy(state))
        unknown = sorted(set(states) - set(by_key))
        if unknown:
            rank_zero_warn(
                f"CallbackGroup {self.name!r}: the checkpoint holds the state of {unknown}, which are not in the group; it is not loaded."
            )

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        for method in self._hooks["on_load_checkpoint"]:
            method(trainer, pl_module, checkpoint)
        states = checkpoint.get("callbacks") or {}
        if self.state_key not in states:  # written with the members apart: their states are at the top level
            self.load_state_dict({m.state_key: states[m.state_key] for m in self.callbacks if m.state_key in states})


def _forward(hook: str) -> Any:
    def forward(self: CallbackGroup, *args: Any, **kwargs: Any) -> None:
        if self._pending and hook in FOLD_BEFORE:  # what the members hold is up to date there
            self._fold()
        for method in self._hooks[hook]:
            method(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = hook
    forward.__doc__ = f"Each member's ``{hook}``, in order."
    return forward


for _hook in HOOKS:
    if _hook not in vars(CallbackGroup):
        setattr(CallbackGroup, _hook, _forward(_hook))


def _defines(callback: Callback, hook: str) -> bool:
    """Whether ``callback``'s ``hook`` is its own (not Callback's no-op) and callable (Lightning skips one that is not)."""
    own = hook in vars(callback) or getattr(type(callback), hook) is not getattr(Callback, hook)
    return own and callable(getattr(callback, hook, None))


def _stateful(callback: Callback) -> bool:
    return type(callback).state_dict is not Callback.state_dict


def group_callbacks(callbacks: Sequence[Callback], name: str = "telemetry") -> list[Callback]:
    """``callbacks`` with the ones a group can hold in one :class:`CallbackGroup`, where the first of them was
    (the others kept, in order); unchanged when fewer than two can be grouped."""
    members = [c for c in callbacks if not isinstance(c, APART)]
    if len(members) < 2:
        return list(callbacks)
    group = CallbackGroup(members, name=name)
    out: list[Callback] = []
    for callback in callbacks:
        if isinstance(callback, APART):
            out.append(callback)
        elif callback is members[0]:
            out.append(group)
    return out
