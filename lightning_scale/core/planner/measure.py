"""What the planner's predictions are checked against on this machine. No Lightning.

:class:`StepTracker` and :func:`tracked_peak`: the peak bytes of live tensor storage over a training
step, as torch's dispatch-level ``MemTracker`` (``torch.distributed._tools.mem_tracker``) counts them:
every tensor allocated or freed, the modules' and optimizers' own state included. Not the process's
RSS (which holds the allocator's cache, the interpreter and libraries) and, on CUDA, what
``max_memory_allocated`` reports without the caching allocator's rounding.

What is counted from the start: the tensors of the modules and optimizers given and, with
``alive=True``, every tensor reachable from the caller's stack, which is what a step keeps from the
ones before it without a module or optimizer holding it: a pipeline stage's receive buffers; FSDP2's
unsharded parameters, whose storage is freed to zero bytes between steps and grown again in place
(the tracker sees that only for a storage it knew before). A DTensor counts its local shard: the
tracker lets DTensor run its local ops and counts their storages, and a DTensor given or found is
flattened to its local tensor. Tensors only C++ holds are out of reach unless allocated while it
tracks: DDP's gradient buckets are, in the second step (DDP rebuilds them at its start), not in a
later one.
"""

from __future__ import annotations

import gc
import inspect
import types
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from lightning_scale.core.compat import memory_tracker

__all__ = ["StepTracker", "tracked_peak"]


class StepTracker:
    """A ``MemTracker`` over one step (``with StepTracker(model, optimizer): ...``, or :meth:`start` and
    :meth:`stop` from two hooks); :attr:`peak`: the peak bytes of live tensors, summed over devices.

    ``MemTracker`` also keeps statistics per module, and refuses a top-level module run twice in a step
    (its check for a second iteration), which a pipeline schedule does once per micro-batch: those
    statistics (which this does not read) are forgotten before a top-level module runs again."""

    def __init__(self, *state: Any, alive: bool = False) -> None:
        self.state, self.alive = state, alive
        self.peak = 0
        self.snapshot: dict[Any, dict[Any, int]] = {}
        """Bytes by kind at the peak (``MemTracker``'s: parameters, gradients, optimizer state,
        activations, temporaries, other), per device."""
        self._tracker: Any = None
        self._hooks: list[Any] = []

    def start(self) -> None:
        tracker = self._tracker = memory_tracker()()
        if self.alive:
            # As "other" first: the modules' and optimizers' own are relabelled below.
            tracker.track_external(*_reachable_tensors())
        if self.state:
            tracker.track_external(*self.state)
        depth = 0

        def before(module: torch.nn.Module, args: Any) -> None:
            nonlocal depth
            if depth == 0:
                tracker.memory_tracking.pop(module, None)
            depth += 1

        def after(module: torch.nn.Module, args: Any, output: Any) -> None:
            nonlocal depth
            depth -= 1

        # Registered before the tracker enters, so these run before its own global module hooks.
        self._hooks = [register_module_forward_pre_hook(before), register_module_forward_hook(after, always_call=True)]
        tracker.__enter__()

    def stop(self) -> int:
        self._tracker.__exit__(None, None, None)
        for hook in self._hooks:
            hook.remove()
        self.snapshot = self._tracker.get_tracker_snapshot("peak")
        self.peak = int(sum(stats["Total"] for stats in self.snapshot.values()))
        return self.peak

    def __enter__(self) -> StepTracker:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _reachable_tensors() -> list[torch.Tensor]:
    """Every tensor reachable from the locals of this thread's stack (the trainer, its modules, optimizers,
    a pipeline schedule's stages, FSDP2's state behind a module's hooks), not through modules, classes or
    functions' globals: not those only C++ still holds (an earlier model's, kept alive by a DDP reducer)."""
    gc.collect()
    roots = []
    frame = inspect.currentframe()
    while frame is not None:  # a running frame's locals are not among its referents
        roots.append(frame.f_locals)
        frame = frame.f_back
    seen: set[int] = set()
    todo: list[Any] = list(roots)
    tensors = []
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        if isinstance(obj, types.FunctionType):
            todo.extend(obj.__closure__ or ())
            continue
        todo.extend(gc.get_referents(obj))
    return tensors


def tracked_peak(step: Callable[[], Any], *state: Any) -> int:
    """Peak bytes of live tensors while ``step()`` runs, the tensors of ``state`` (modules, optimizers)
    counted from the start; summed over devices."""
    with StepTracker(*state) as tracker:
        step()
    return tracker.peak
