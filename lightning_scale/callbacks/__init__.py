"""Lightning callbacks: thin adapters; timing and maths live in ``lightning_scale.core``."""

from lightning_scale.callbacks.checkpoint_advisor import CheckpointIntervalAdvisor
from lightning_scale.callbacks.console import ConsoleLogger
from lightning_scale.callbacks.cost import CostMonitor
from lightning_scale.callbacks.goodput import GoodputMonitor
from lightning_scale.callbacks.grad_norm import GradNormMonitor
from lightning_scale.callbacks.group import CallbackGroup, each_callback
from lightning_scale.callbacks.hang_watchdog import HangWatchdog
from lightning_scale.callbacks.health import NumericalHealth
from lightning_scale.callbacks.memory import MemoryMonitor
from lightning_scale.callbacks.preemption import Preempted, PreemptionCheckpoint
from lightning_scale.callbacks.step_time import StepTimeBreakdown
from lightning_scale.callbacks.stragglers import STRAGGLER_EXIT_CODE, StragglerMonitor, StragglerRestart
from lightning_scale.callbacks.sync import SyncMonitor
from lightning_scale.callbacks.throughput import Throughput

__all__ = [
    "STRAGGLER_EXIT_CODE",
    "CallbackGroup",
    "CheckpointIntervalAdvisor",
    "ConsoleLogger",
    "CostMonitor",
    "GoodputMonitor",
    "GradNormMonitor",
    "HangWatchdog",
    "MemoryMonitor",
    "NumericalHealth",
    "Preempted",
    "PreemptionCheckpoint",
    "StepTimeBreakdown",
    "StragglerMonitor",
    "StragglerRestart",
    "SyncMonitor",
    "Throughput",
    "each_callback",
]
