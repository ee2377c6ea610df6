"""``MemoryMonitor``: memory per logging interval, the figures that say whether a layout will fit."""

from __future__ import annotations

import resource

import torch
from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lightning_scale.callbacks import _telemetry as telemetry

__all__ = ["MemoryMonitor"]

_GIB = 2**30


def _resident_bytes() -> float:
    """This process's resident set now (Linux ``/proc/self/statm``; the peak where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return float(f.read().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return _peak_resident_bytes()


def _peak_resident_bytes() -> float:
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


class MemoryMonitor(telemetry.SharedTelemetry):
    """Log memory at Lightning's logging steps, the largest value over the processes.

    On a GPU (CUDA's caching allocator), for the interval since the last logging step:
    ``memory/peak_allocated_gib`` (tensors), ``memory/peak_reserved_gib`` (what the allocator holds:
    what ``nvidia-smi`` shows, less the CUDA context), and since the fit started
    ``memory/alloc_retries`` (the allocator freed its cache to satisfy a request: a sign of
    fragmentation or of running at the edge) and ``memory/ooms``. Elsewhere (CPU):
    ``memory/rss_gib`` (resident now) and ``memory/peak_rss_gib`` (the process's peak).

    A few numbers in the logging step's one all-reduce (shared with the other telemetry callbacks); the
    peaks are reset after each reading.
    """

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._device = trainer.strategy.root_device
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)

    @override
    def needs_steps(self) -> bool:
        return False

    @override
    def logging_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        mine = self.read()
        telemetry.contribute(
            trainer, self, telemetry.Share(list(mine.values()), "max", lambda top: dict(zip(mine, top)))
        )

    def read(self) -> dict[str, float]:
        """This process's figures (see the class doc)."""
        if self._device.type == "cuda":
            stats = torch.cuda.memory_stats(self._device)
            out = {
                "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(self._device) / _GIB,
                "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(self._device) / _GIB,
                "memory/alloc_retries": float(stats.get("num_alloc_retries", 0)),
                "memory/ooms": float(stats.get("num_ooms", 0)),
            }
            torch.cuda.reset_peak_memory_stats(self._device)  # the next interval's peaks
            return out
        resident = _resident_bytes()
        # getrusage's peak lags the resident set (the kernel updates it lazily): it read 0.02% below
        # the resident set read just before it, so the peak is at least the resident set now.
        return {"memory/rss_gib": resident / _GIB, "memory/peak_rss_gib": max(_peak_resident_bytes(), resident) / _GIB}
