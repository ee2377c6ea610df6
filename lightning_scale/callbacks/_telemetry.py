"""What the telemetry callbacks share: the clock, the run's shape, one reduction, publishing metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_scale._lightning_compat import log_metrics
from lightning_scale._lightning_hooks import restore_hooks, skip_hooks
from lightning_scale.callbacks import _steps
from lightning_scale.callbacks._steps import (
    READS,
    CallbackSet,
    Duration,
    Step,
    StepRecorder,
    TrainClock,
    each_callback,
    forget_logging_step,
    should_log,
    stamp,
)
from lightning_scale.core.telemetry.model_facts import ModelFacts

__all__ = [
    "READS",
    "CallbackSet",
    "Duration",
    "Share",
    "SharedTelemetry",
    "Step",
    "StepRecorder",
    "TimedCallback",
    "TrainClock",
    "compute_dtype",
    "contribute",
    "device_name",
    "each_callback",
    "forget_logging_step",
    "model_facts",
    "on_checkpoint_saved",
    "on_collective",
    "stamp",
    "publish",
    "reduce_sum",
    "replicas",
    "should_log",
    "since",
    "sync_stats_reader",
]

_LISTENERS = "_lightning_scale_checkpoint_listeners"


def on_checkpoint_saved(trainer: Trainer, listener: Callable[[float], None]) -> Callable[[], None]:
    """Call ``listener(seconds)`` after each ``trainer.save_checkpoint`` with the time it blocked
    (``ModelCheckpoint``, preemption and user saves all go through it); returns the remover. One
    wrapper per Trainer, shared by every listener."""
    listeners: list[Callable[[float], None]] | None = trainer.__dict__.get(_LISTENERS)
    if listeners is None:
        listeners = trainer.__dict__[_LISTENERS] = []
        save = trainer.save_checkpoint

        def timed_save(*args: Any, **kwargs: Any) -> Any:
            global _saving
            begin = _steps.clock()
            _saving += 1
            try:
                return save(*args, **kwargs)
            finally:
                _saving -= 1
                spent = _steps.clock() - begin
                for listener_ in list(listeners):
                    listener_(spent)

        trainer.save_checkpoint = timed_save  # type: ignore[method-assign]
    listeners.append(listener)
    return lambda: listener in listeners and listeners.remove(listener)  # type: ignore[func-returns-value]


class TimedCallback(Callback):
    """Base of the callbacks that time training: ``self._clock`` stands still during validation inside
    ``fit``; ``self._cleanups`` run when the fit ends or fails."""

    def __init__(self) -> None:
        self._clock = TrainClock()
        self._cleanups: list[Callable[[], Any]] = []

    def _run_cleanups(self) -> None:
        while self._cleanups:
            self._cleanups.pop()()

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        forget_logging_step(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._clock.pause()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._clock.resume()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._run_cleanups()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._run_cleanups()


def _on_cuda(args: tuple[Any, ...]) -> bool:
    first = args[0] if args else None
    if isinstance(first, (list, tuple)) and first:
        first = first[0]
    return isinstance(first, torch.Tensor) and first.is_cuda


_saving = 0  # saves in progress: their collectives are checkpoint time, not communication
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
)
_collective_listeners: list[Callable[[Duration], None]] = []
_originals: dict[str, Any] = {}
_depth = 0


def on_collective(listener: Callable[[Duration], None]) -> Callable[[], None]:
    """Call ``listener(duration)`` after each synchronous ``torch.distributed`` collective called from
    Python (``dist.all_reduce(...)`` and the others in :data:`COLLECTIVES`, outside checkpoint saves;
    one inside another counts once); returns the remover. On CUDA tensors the duration is between two
    CUDA events around the call (an NCCL call returns to the host before the transfer ends; the
    events time it on the GPU), else host time. Calls with ``async_op=True`` return before
    the transfer and are not timed, nor are collectives issued from C++ (DDP's bucketed all-reduces)
    or through functional collectives (DTensor): those overlap with compute and stay in it. The
    functions are wrapped while any listener is registered."""
    if not _collective_listeners:
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            _originals[name] = original

            def timed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                global _depth
                if kwargs.get("async_op") or _depth:
                    return _original(*args, **kwargs)
                _depth += 1
                cuda = _on_cuda(args)
                begin = stamp(cuda)
                try:
                    return _original(*args, **kwargs)
                finally:
                    _depth -= 1
                    if not _saving:
                        spent = Duration(begin, stamp(cuda))
                        for listener_ in list(_collective_listeners):
                            listener_(spent)

            setattr(dist, name, timed)
    _collective_listeners.append(listener)

    def remove() -> None:
        if listener in _collective_listeners:
            _collective_listeners.remove(listener)
        if not _collective_listeners:
            for name, original in _originals.items():
                setattr(dist, name, original)
            _originals.clear()

    return remove


def replicas(trainer: Trainer) -> int:
    """Data-parallel replicas: the processes that see different data (dp), not the world."""
    try:
        kwargs = trainer.strategy.distributed_sampler_kwargs
    except (AttributeError, RuntimeError, NotImplementedError):
        kwargs = None
    replicas = (kwargs or {}).get("num_replicas")
    return int(replicas) if replicas else trainer.world_size


def model_facts(trainer: Trainer, module: LightningModule) -> ModelFacts:
    """The strategy's facts of the whole model (taken before it was cut), or the module's own counts
    for strategies that do not cut it (DDP; FSDP2's DTensors report global sizes)."""
    facts = getattr(trainer.strategy, "model_facts", None)
    return facts if isinstance(facts, ModelFacts) else ModelFacts.of(module)


def sync_stats_reader(trainer: Trainer) -> Callable[[], Mapping[str, Any]] | None:
    """The strategy's ``sync_stats`` (``HybridParallelStrategy``'s): what its data-parallel exchange did since the
    fit started or the checkpoint it resumed, this process's (``mode``, ``every``, ``bytes_sent``, ``exchanges``,
    ``blocked_s``); None for a strategy that keeps no such record (Lightning's own), on every process alike."""
    read = getattr(trainer.strategy, "sync_stats", None)
    return read if callable(read) else None


def since(now: float, last: float) -> float:
    """The growth of a counter since the reading ``last``; ``now`` itself when it restarted (a new fit's)."""
    return now - last if now >= last else now


def compute_dtype(trainer: Trainer) -> str:
    """The dtype matmuls run in under ``Trainer(precision=...)`` (a ``core.telemetry.peaks`` dtype name)."""
    precision = str(trainer.precision)
    if precision.startswith("bf16"):
        return "bfloat16"
    if precision.startswith("16"):
        return "float16"
    if precision.startswith("64"):
        return "float64"
    if "transformer-engine" in precision:
        return "float8"
    if trainer.strategy.root_device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "float32"


def device_name(trainer: Trainer) -> str:
    device = trainer.strategy.root_device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _distributed(trainer: Trainer) -> bool:
    return dist.is_available() and dist.is_initialized() and trainer.world_size > 1


def _all_reduce(trainer: Trainer, values: list[float], op: Any = None) -> list[float]:
    """One all-reduce of float64 numbers (on the GPU under NCCL: one host sync, to read them)."""
    device = trainer.strategy.root_device if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op)
    return tensor.tolist()


def reduce_sum(trainer: Trainer, values: Iterable[float], op: Any = None) -> list[float]:
    """Sum (or ``op``, e.g. ``dist.ReduceOp.MAX``) over every process: one all-reduce of float64
    numbers; none when not distributed."""
    values = list(values)
    return _all_reduce(trainer, values, op) if _distributed(trainer) else values


class Share(NamedTuple):
    """A telemetry callback's part of a logging step's one collective (:func:`contribute`)."""

    values: Sequence[float]
    """This process's numbers (as many on every process)."""
    op: Literal["sum", "max", "gather"]
    """Each number's sum or maximum over the processes, or ``"gather"``: every process's numbers, by rank."""
    finish: Callable[[list[Any]], Mapping[str, float]]
    """The reduced numbers (``"gather"``: a list per process) -> the metrics to publish."""
    prog_bar: tuple[str, ...] = ()
    then: Callable[[], Any] | None = None
    """Called after every part's metrics were published (an action the metrics decide)."""


class SharedTelemetry(TimedCallback):
    """Base of the callbacks that publish through :func:`contribute` at every logging step (each of them on
    every process): those of one Trainer share one collective per logging step, whichever of them it holds.

    Their per-step work is folding :class:`Step` records into their sums (``fold_steps``), their logging step's
    work ``logging_step``. Alone, such a callback records its own steps in its per-step hooks; in a
    :class:`~lightning_scale.callbacks.group.CallbackGroup` the group records each step once for all of them
    (when they ``share_steps``), has them fold the records at logging steps, and runs nothing of theirs between.
    """

    sizes = False
    """Whether it needs each batch's samples and tokens (:meth:`StepRecorder.reset`'s ``sizes``)."""
    cuda_edges = False
    """Whether it times spans by CUDA events on a GPU."""
    reads: tuple[str, ...] = ()
    """The clock readings of each step it folds (:data:`READS`)."""

    def __init__(self) -> None:
        super().__init__()
        self._own = StepRecorder()
        self._shared: StepRecorder | None = None  # a CallbackGroup's
        self._start_idle = False  # alone, and its batch start's hook still dispatched though it would do nothing

    @property
    def steps(self) -> StepRecorder:
        """The recorder of this callback's steps: its group's, or its own."""
        return self._shared if self._shared is not None else self._own

    def share_steps(self) -> bool:
        """Whether a group's recorder (the default batch shape, no token count) serves this callback."""
        return True

    def record_options(self, trainer: Trainer) -> dict[str, Any]:
        """What a recorder of this callback's steps takes (:meth:`StepRecorder.reset`)."""
        cuda = self.cuda_edges and trainer.strategy.root_device.type == "cuda"
        return {"cuda": cuda, "sizes": self.sizes, "reads": self.reads}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        restore_hooks(self)
        if self._shared is None:
            options = self.record_options(trainer)
            self._own.reset(**options)
            # Alone, Lightning dispatches every per-step hook to it: the ones it has no use for are taken out.
            idle = ["on_before_backward", "on_after_backward", "on_before_zero_grad"]
            if "optimizer" not in options["reads"]:
                idle.append("on_before_optimizer_step")
            skip_hooks(self, [h for h in idle if getattr(type(self), h) is getattr(SharedTelemetry, h)])
        # Once it needs no records, its batch start does nothing (unless a subclass has its own).
        own_start = type(self).on_train_batch_start is SharedTelemetry.on_train_batch_start
        self._start_idle = self._shared is None and own_start and not (self.sizes or "start" in self.reads)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_start(trainer, pl_module)
        if self._shared is None:
            self._own.pause()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._shared is None:
            self._own.resume()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._own.batch_start(trainer, batch)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._own.optimizer()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.needs_steps():  # the logging-step check alone
            if should_log(trainer):
                self.logging_step(trainer, pl_module)
            if self._start_idle:
                self._start_idle = False
                skip_hooks(self, ["on_train_batch_start"])  # nothing to record at a batch's start either
            return
        step = self._own.batch_end(trainer)
        self.fold_steps(trainer, pl_module, (step,))
        if step.log:
            self.logging_step(trainer, pl_module)
        self._own.finish(step)

    def needs_steps(self) -> bool:
        """Whether it folds steps now (False: alone, its only per-step work is the logging-step check)."""
        return True

    def fold_steps(self, trainer: Trainer, pl_module: LightningModule, steps: Sequence[Step]) -> None:
        """Add the steps (in order, each once) to this callback's sums."""

    def logging_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """At a logging step, after the steps up to it were folded: this callback's part (:func:`contribute`)."""


_ROUND = "_lightning_scale_telemetry_round"


class _Round:
    def __init__(self) -> None:
        self.step = -1
        self.parts: list[Share] = []


def contribute(trainer: Trainer, callback: SharedTelemetry, share: Share) -> None:
    """At a logging step, ``callback``'s part of the step's telemetry. Once the last :class:`SharedTelemetry`
    callback in ``trainer.callbacks`` (a ``CallbackGroup``'s members in its place) contributed (at once when
    ``callback`` is not there): one all-reduce of every part's numbers (float64; none when not distributed or there are none), each part's ``finish``, one :func:`publish` of
    all their metrics, then each ``then``. The callbacks' hooks run in list order on every process, so the
    processes reduce alike; a part still pending at a later step (a callback that did not contribute) is
    reduced first then."""
    round_ = trainer.__dict__.get(_ROUND)
    if round_ is None:
        round_ = trainer.__dict__[_ROUND] = _Round()
    step = trainer.global_step
    if round_.parts and round_.step != step:
        _reduce_round(trainer, round_)
    round_.step = step
    round_.parts.append(share)
    members = [c for c in each_callback(trainer) if isinstance(c, SharedTelemetry)]
    if callback not in members or members[-1] is callback:
        _reduce_round(trainer, round_)


def _reduce_round(trainer: Trainer, round_: _Round) -> None:
    parts, round_.parts = round_.parts, []
    sums = [float(v) for part in parts if part.op == "sum" for v in part.values]
    own = [float(v) for part in parts if part.op != "sum" for v in part.values]  # every process's, by rank
    if _distributed(trainer) and (sums or own):
        # Sums and per-process numbers in one all-reduce: this process's in its own row of zeros.
        world, rank = dist.get_world_size(), dist.get_rank()
        flat = [*sums, *[0.0] * (world * len(own))]
        flat[len(sums) + rank * len(own) : len(sums) + (rank + 1) * len(own)] = own
        flat = _all_reduce(trainer, flat)
    else:
        world, flat = 1, [*sums, *own]
    rows = [flat[len(sums) + r * len(own) : len(sums) + (r + 1) * len(own)] for r in range(world)]
    metrics: dict[str, float] = {}
    prog_bar: list[str] = []
    at_sum = at_row = 0
    for part in parts:
        n = len(part.values)
        if part.op == "sum":
            reduced: list[Any] = flat[at_sum : at_sum + n]
            at_sum += n
        else:
            gathered = [row[at_row : at_row + n] for row in rows]
            at_row += n
            reduced = gathered if part.op == "gather" else [max(column) for column in zip(*gathered)]
        metrics.update(part.finish(reduced))
        prog_bar += part.prog_bar
    publish(trainer, metrics, prog_bar)
    for part in parts:
        if part.then is not None:
            part.then()


def publish(trainer: Trainer, metrics: Mapping[str, float], prog_bar: Iterable[str] = ()) -> None:
    """To the loggers (global rank 0), ``trainer.callback_metrics`` (``ModelCheckpoint``, ``ConsoleLogger``,
    ``EarlyStopping`` read them) and the progress bar (the ``prog_bar`` keys)."""
    if not metrics:
        return
    # One tensor, a 0-d view of it per metric (a tensor each would cost ~30x more at 30 metrics).
    tensors = dict(zip(metrics, torch.tensor([float(v) for v in metrics.values()]).unbind()))
    trainer.callback_metrics.update(tensors)
    trainer.progress_bar_metrics.update({k: float(metrics[k]) for k in prog_bar if k in metrics})
    if trainer.is_global_zero:
        log_metrics(trainer, dict(tensors), step=trainer.global_step)
