"""Count profiler events (collectives, FSDP phases) per optimizer step of a Lightning fit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch import Callback, Trainer
from torch.profiler import ProfilerActivity, profile

__all__ = ["CountEvents"]


class CountEvents(Callback):
    """For every optimizer step (all micro-steps of an accumulation window), how many profiler events
    have a name containing each of ``names``: ``counts[step][name]``."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.counts: list[dict[str, int]] = []
        self._prof: Any = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._prof = profile(activities=[ProfilerActivity.CPU])
            self._prof.__enter__()

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self._prof.__exit__(None, None, None)
            events = self._prof.key_averages()
            self.counts.append({n: sum(e.count for e in events if n in e.key) for n in self.names})
