"""Models built on the meta device: where ``HybridParallelStrategy`` creates them, and how each rank
materialises its part once the model is cut and sharded (``lightning_scale.core.parallel.deferred_init``)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_scale.core.parallel.deferred_init import DeferredInit
from lightning_scale.core.pipeline.runner import PipelineRunner

__all__ = ["DeferredModules"]


class DeferredModules:
    """Mixin for ``HybridParallelStrategy``."""

    root_device: torch.device
    precision_plugin: Any
    world_size: int
    _pipeline: PipelineRunner | None
    broadcast: Callable[..., Any]  # WorldCollectives'
    model_to_device: Callable[[], None]

    def _plan_or_move_to_device(self, module: LightningModule) -> DeferredInit | None:
        """A module with tensors on the meta device is planned, not moved: ``setup`` cuts and shards it
        first, then :meth:`_materialize` gives each rank its part. Its real tensors go to the device now."""
        deferred = DeferredInit.plan(module)
        if deferred is None:
            self.model_to_device()
        else:
            device = self.root_device
            module._apply(lambda t: t if t.is_meta else t.to(device))
        return deferred

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Modules created here (``configure_model``, ``trainer.init_module()``) go on the meta device
        unless ``empty_init=False``: ``setup`` cuts and shards them, then allocates and initialises
        each rank's part (``lightning_scale.core.parallel.deferred_init`` says how and with which hooks).
        Weights loaded into them here would be lost: load them with ``ckpt_path``."""
        device = self.root_device if empty_init is False else torch.device("meta")
        with device, self.precision_plugin.tensor_init_context():
            yield

    def _materialize(self, module: LightningModule, deferred: DeferredInit) -> None:
        """Allocate and initialise this rank's part of a deferred module, seeded alike on every rank."""
        seed = int(self.broadcast(torch.initial_seed()))  # unseeded processes differ; rank 0's wins
        extra = self._pipeline.stage_modules() if self._pipeline is not None else []
        problems = deferred.materialize(module, self.root_device, seed, extra_roots=extra)
        everyone: list[list[str]] = [[] for _ in range(self.world_size)]
        torch.distributed.all_gather_object(everyone, problems)
        found = sorted({p for rank in everyone for p in rank})
        if found:
            raise ValueError(
                f"Deferred initialisation left {len(found)} tensors uninitialised: {found[:5]}. The initialiser that "
                "ran for each module must set all of its parameters and buffers: extend it (reset_parameters() or "
                "the model's _init_weights(module)), or create that module on a real device."
            )
        rank_zero_info(f"Deferred initialisation: {deferred.num_tensors} tensors, each rank materialised its own part")

