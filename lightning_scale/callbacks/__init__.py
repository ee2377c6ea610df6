"""Lightning callbacks: thin adapters; timing and maths live in ``lightning_scale.core``."""

from lightning_scale.callbacks.console import ConsoleLogger

__all__ = ["ConsoleLogger"]
