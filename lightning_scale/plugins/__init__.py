"""Lightning plugins: precision (fp16 loss scaling decided once for the whole mesh, bf16 at every layout) and
sharded checkpoints (every rank writes its own part; atomic, verified, resharding)."""

from lightning_scale.plugins.checkpoint_io import PREEMPTION_EXIT_CODE, ShardedCheckpointIO
from lightning_scale.plugins.precision import MixedPrecision

__all__ = ["PREEMPTION_EXIT_CODE", "MixedPrecision", "ShardedCheckpointIO"]
