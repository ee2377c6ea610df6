"""Taking a callback's per-step hooks out of Lightning's dispatch.

Lightning calls every hook of every callback it holds at every training step, a no-op one included, each
inside a profiler context named by an f-string of the callback's ``state_key``: six hooks a step per
callback, some microseconds each on a CPU, before the hook does anything. It calls a hook only when the
callback's attribute of that name is callable (``lightning.pytorch.trainer.call._call_callback_hooks``:
``fn = getattr(callback, hook_name); if callable(fn): ...``, in every release since 1.6), so an instance
attribute of ``None`` takes the hook out of the dispatch for that callback alone, and deleting it puts the
class's method back. ``tests/test_callback_group.py`` checks it on the installed Lightning (a hook skipped
this way is not called, and the fit runs).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["STEP_HOOKS", "restore_hooks", "skip_hooks"]

STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)
"""The hooks Lightning calls on every callback at every training step."""


def skip_hooks(callback: Any, hooks: Iterable[str]) -> None:
    """Lightning no longer calls ``hooks`` on ``callback`` (this instance only), until :func:`restore_hooks`."""
    for name in hooks:
        setattr(callback, name, None)


def restore_hooks(callback: Any) -> None:
    """Every hook :func:`skip_hooks` took out of ``callback``'s dispatch is its class's method again."""
    for name in STEP_HOOKS:
        if name in vars(callback) and vars(callback)[name] is None:
            delattr(callback, name)
