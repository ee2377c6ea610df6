"""Lightning callbacks: thin adapters; timing and maths live in ``lightning_scale.core``."""

from lightning_scale.callbacks.console import ConsoleLogger
from lightning_scale.callbacks.grad_norm import GradNormMonitor

__all__ = ["ConsoleLogger", "GradNormMonitor"]
