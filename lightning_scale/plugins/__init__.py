"""Lightning plugins: precision (fp16 loss scaling decided once for the whole mesh, bf16 at every layout) and
sharded checkpoints (every rank writes its own part; atomic, verified, resharding); the exit statuses a
relaunch reads: :data:`PREEMPTION_EXIT_CODE` (143, a checkpoint was committed on SIGTERM/SIGUSR1),
:data:`HANG_EXIT_CODE` (75, a training step stalled: :class:`HangWatchdog` wrote every rank's stacks) and
:data:`STRAGGLER_EXIT_CODE` (76, a checkpoint was committed because a rank stayed slow:
``StragglerMonitor(action="restart")`` wrote ``stragglers/exclude.json``, naming the host to leave out)."""

from lightning_scale.core.resilience.stragglers import STRAGGLER_EXIT_CODE
from lightning_scale.plugins.checkpoint_io import PREEMPTION_EXIT_CODE, ShardedCheckpointIO
from lightning_scale.plugins.hang_watchdog import HANG_EXIT_CODE, HangWatchdog
from lightning_scale.plugins.precision import MixedPrecision

__all__ = [
    "HANG_EXIT_CODE",
    "PREEMPTION_EXIT_CODE",
    "STRAGGLER_EXIT_CODE",
    "HangWatchdog",
    "MixedPrecision",
    "ShardedCheckpointIO",
]
