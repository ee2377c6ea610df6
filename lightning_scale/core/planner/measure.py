"""What the planner's predictions are checked against on this machine. No Lightning.

:func:`tracked_peak`: the peak bytes of live tensor storage over a callable, as torch's dispatch-level
``MemTracker`` (``torch.distributed._tools.mem_tracker``) counts them: every tensor allocated or
freed, the modules' and optimizers' own state included. Not the process's RSS (which holds the
allocator's cache, the interpreter and libraries) and, on CUDA, what ``max_memory_allocated`` reports
without the caching allocator's rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_scale.core.compat import memory_tracker

__all__ = ["tracked_peak"]


def tracked_peak(step: Callable[[], Any], *state: Any) -> int:
    """Peak bytes of live tensors while ``step()`` runs, the tensors of ``state`` (modules, optimizers)
    counted from the start; summed over devices."""
    tracker = memory_tracker()()
    if state:
        tracker.track_external(*state)
    with tracker:
        step()
    return int(sum(stats["Total"] for stats in tracker.get_tracker_snapshot("peak").values()))
