"""``HangWatchdog``, where callbacks are looked for. It lives in :mod:`lightning_scale.plugins.hang_watchdog`:
``HybridParallelStrategy`` adds one to every ``fit``, and strategies never import callbacks."""

from lightning_scale.plugins.hang_watchdog import HangWatchdog

__all__ = ["HangWatchdog"]
