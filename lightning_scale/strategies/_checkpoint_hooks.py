"""Lightning's checkpoint hooks of a strategy, with full (gathered) state under the original names,
so a checkpoint saved at one layout loads at any other."""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch import LightningModule
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_scale.core.full_state import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
)
from lightning_scale.core.layout import Layout

__all__ = ["FullStateCheckpoints"]


class FullStateCheckpoints:
    """Mixin for ``HybridParallelStrategy``: every rank takes part (the gathers are collectives)."""

    layout: Layout
    device_mesh: DeviceMesh
    lightning_module: LightningModule
    model: Any
    optimizers: list[Any]
    checkpoint_io: CheckpointIO

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A local checkpoint file is memory-mapped: its tensors are read when a rank copies its shard
        out of them, so no rank reads (or holds) the whole model, only the pages of what it keeps."""
        path = Path(checkpoint_path) if isinstance(checkpoint_path, (str, Path)) else None
        if type(self.checkpoint_io) is TorchCheckpointIO and path is not None and path.is_file() and zipfile.is_zipfile(path):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        return self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only)

    def _pp_group(self) -> Any:
        return self.device_mesh["pp"].get_group() if self.layout.pp > 1 else None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return full_model_state(self.lightning_module, self._pp_group())

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        load_full_model_state(self.lightning_module, checkpoint["state_dict"], strict=strict, partial=self.layout.pp > 1)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return full_optimizer_state(self.lightning_module, getattr(optimizer, "_optimizer", optimizer), self._pp_group())

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            load_full_optimizer_state(
                self.lightning_module, getattr(optimizer, "_optimizer", optimizer), state, partial=self.layout.pp > 1
            )

