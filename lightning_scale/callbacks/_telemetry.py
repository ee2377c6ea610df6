"""What the telemetry callbacks share: the clock, the run's shape, one reduction, publishing metrics."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_scale._lightning_compat import log_metrics, should_accumulate, should_update_logs
from lightning_scale.callbacks.group import each_callback
from lightning_scale.core.telemetry.model_facts import ModelFacts, batch_shape

__all__ = ["Duration", "Share", "SharedTelemetry", "TimedCallback", "TrainClock", "batch_tokens", "compute_dtype", "contribute",
           "device_name", "forget_logging_step", "model_facts", "on_checkpoint_saved", "on_collective", "stamp", "publish", "reduce_sum", "replicas",
           "should_log"]

clock: Callable[[], float] = time.perf_counter
"""Every telemetry callback's clock (tests patch it)."""


class TrainClock:
    """Training time: the clock minus the time spent in validation inside ``fit``."""

    def __init__(self) -> None:
        self._paused_at: float | None = None
        self._paused = 0.0

    def now(self) -> float:
        return (self._paused_at if self._paused_at is not None else clock()) - self._paused

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = clock()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused += clock() - self._paused_at
            self._paused_at = None


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
            begin = clock()
            _saving += 1
            try:
                return save(*args, **kwargs)
            finally:
                _saving -= 1
                spent = clock() - begin
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


class Duration:
    """A span's length, read when it is needed: two host-clock readings, or two CUDA events recorded on
    the current stream (their GPU time apart, read once the later one completed: no synchronisation
    when they are taken, one when a logging step reads them)."""

    __slots__ = ("end", "start")

    def __init__(self, start: Any, end: Any) -> None:
        self.start, self.end = start, end

    def seconds(self) -> float:
        if isinstance(self.start, float):
            return self.end - self.start
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


def stamp(cuda: bool) -> Any:
    """Now: a CUDA event recorded on the current stream (``cuda``), else :data:`clock`'s reading."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return clock()


def _on_cuda(args: tuple[Any, ...]) -> bool:
    first = args[0] if args else None
    if isinstance(first, (list, tuple)) and first:
        first = first[0]
    return isinstance(first, torch.Tensor) and first.is_cuda


_saving = 0  # saves in progress: their collectives are checkpoint time, not communication
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "gather", "scatter", "barrier", "all_gather_object", "broadcast_object_list")
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


def batch_tokens(batch: Any, shape_fn: Callable[[Any], tuple[int, int]] | None) -> tuple[int, int]:
    """``(samples, tokens per sample)`` of a batch, by ``shape_fn`` when given."""
    shape = shape_fn(batch) if shape_fn is not None else batch_shape(batch)
    if shape is None:
        raise ValueError(
            f"Cannot tell the samples and tokens of a batch of type {type(batch).__name__}: no tensor found. "
            "Pass batch_shape=lambda batch: (samples, tokens_per_sample)."
        )
    return int(shape[0]), int(shape[1])


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
    every process): those of one Trainer share one collective per logging step, whichever of them it holds."""


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
        flat[len(sums) + rank * len(own):len(sums) + (rank + 1) * len(own)] = own
        flat = _all_reduce(trainer, flat)
    else:
        world, flat = 1, [*sums, *own]
    rows = [flat[len(sums) + r * len(own):len(sums) + (r + 1) * len(own)] for r in range(world)]
    metrics: dict[str, float] = {}
    prog_bar: list[str] = []
    at_sum = at_row = 0
    for part in parts:
        n = len(part.values)
        if part.op == "sum":
            reduced: list[Any] = flat[at_sum:at_sum + n]
            at_sum += n
        else:
            gathered = [row[at_row:at_row + n] for row in rows]
            at_row += n
            reduced = gathered if part.op == "gather" else [max(column) for column in zip(*gathered)]
        metrics.update(part.finish(reduced))
        prog_bar += part.prog_bar
    publish(trainer, metrics, prog_bar)
    for part in parts:
        if part.then is not None:
            part.then()


_LOGGING = "_lightning_scale_logging_batch"


def should_log(trainer: Trainer) -> bool:
    """At Lightning's logging steps (``Trainer(log_every_n_steps=...)``), once the accumulation window closed.
    Decided once per training batch, for every callback alike (a later callback setting ``should_stop``, which
    Lightning also logs at, does not split them: each takes part in the logging step's reduction or none does)."""
    batch = trainer.fit_loop.epoch_loop.batch_progress.total.ready  # counts every batch of the fit, never repeats
    decided = trainer.__dict__.get(_LOGGING)
    if decided is not None and decided[0] == batch:
        return decided[1]
    logging = should_update_logs(trainer) and not should_accumulate(trainer)
    trainer.__dict__[_LOGGING] = (batch, logging)
    return logging


def forget_logging_step(trainer: Trainer) -> None:
    """At a fit's start: a fit resumed from an earlier checkpoint counts its batches from there again, so
    :func:`should_log`'s decision for a batch of an earlier fit must not stand for one of this fit."""
    trainer.__dict__.pop(_LOGGING, None)


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
