"""``PreemptionCheckpoint`` and ``Preempted``, where callbacks are looked for. They live in
:mod:`lightning_scale.plugins.preemption`: ``HybridParallelStrategy`` adds one to every ``fit``, and
strategies never import callbacks."""

from lightning_scale.plugins.preemption import Preempted, PreemptionCheckpoint

__all__ = ["Preempted", "PreemptionCheckpoint"]
