"""Lightning callbacks: thin adapters; timing and maths live in ``lightning_scale.core``."""

from lightning_scale.callbacks.console import ConsoleLogger
from lightning_scale.callbacks.grad_norm import GradNormMonitor
from lightning_scale.callbacks.preemption import Preempted, PreemptionCheckpoint

__all__ = ["ConsoleLogger", "GradNormMonitor", "Preempted", "PreemptionCheckpoint"]
