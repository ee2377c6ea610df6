"""Lightning plugins: precision (fp16 loss scaling decided once for the whole mesh, bf16 at every layout) and
sharded checkpoints (every rank writes its own part; atomic, verified, resharding); the exit statuses a
relaunch reads: :data:`PREEMPTION_EXIT_CODE` (143, a checkpoint was committed on SIGTERM/SIGUSR1),
:data:`HANG_EXIT_CODE` (75, a training step stalled: the hang watchdog wrote every rank's stacks) and
:data:`STRAGGLER_EXIT_CODE` (76, a checkpoint was committed because a rank stayed slow:
``StragglerMonitor(action="restart")`` wrote ``stragglers/exclude.json``, naming the host to leave out).

Only Lightning plugins live here: the hang watchdog and the preemption checkpoint are callbacks
(:mod:`lightning_scale.callbacks`; ``HybridParallelStrategy`` has both built in). ``lightning_scale.plugins.HangWatchdog``,
``lightning_scale.plugins.hang_watchdog`` and ``lightning_scale.plugins.preemption`` still import, with a
``DeprecationWarning`` naming the new path."""

from lightning_scale.core.deprecation import moved_modules, moved_names
from lightning_scale.core.resilience.stragglers import STRAGGLER_EXIT_CODE
from lightning_scale.core.resilience.watchdog import HANG_EXIT_CODE
from lightning_scale.plugins.checkpoint_io import PREEMPTION_EXIT_CODE, ShardedCheckpointIO
from lightning_scale.plugins.precision import MixedPrecision

__all__ = [
    "HANG_EXIT_CODE",
    "PREEMPTION_EXIT_CODE",
    "STRAGGLER_EXIT_CODE",
    "MixedPrecision",
    "ShardedCheckpointIO",
]


# The watchdog and the preemption checkpoint are callbacks, for strategies without their own (issue 39).
__getattr__ = moved_names(__name__, {"HangWatchdog": "lightning_scale.callbacks.hang_watchdog.HangWatchdog"})
moved_modules(
    __name__,
    {
        "hang_watchdog": ("lightning_scale.callbacks.hang_watchdog",),
        "preemption": ("lightning_scale.callbacks.preemption",),
    },
)
