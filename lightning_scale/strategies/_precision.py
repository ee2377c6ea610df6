"""The precision plugin of ``HybridParallelStrategy``: always ``MixedPrecision``, with the mesh's
gradient scope (which rank counts which gradient piece in the one all-reduce per step)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_scale.core.precision.grad_norm import GradientScope, gradient_stats, reduce_partial_grads_
from lightning_scale.core.pipeline.runner import PipelineRunner
from lightning_scale.plugins._stock import as_mesh_precision
from lightning_scale.plugins.precision import MixedPrecision

__all__ = ["MeshPrecision"]


class MeshPrecision:
    """Mixin for ``HybridParallelStrategy`` (before Lightning's ``ParallelStrategy`` in the bases)."""

    _precision_plugin: Precision | None
    _default_precision: MixedPrecision | None = None
    _pipeline: PipelineRunner | None
    device_mesh: DeviceMesh

    @property
    @override
    def precision_plugin(self) -> MixedPrecision:
        """Always a :class:`~lightning_scale.plugins.MixedPrecision`: Lightning's stock plugins (what
        ``Trainer(precision="bf16-mixed")`` builds) are replaced by the equivalent one, others refused."""
        if self._precision_plugin is not None:
            return self._precision_plugin  # type: ignore[return-value]
        if self._default_precision is None:
            self._default_precision = MixedPrecision("32-true")
        return self._default_precision

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # None stays None: Lightning's connector reads `_precision_plugin` to tell a plugin given to the
        # strategy from one given to the Trainer.
        self._precision_plugin = None if precision_plugin is None else as_mesh_precision(precision_plugin)

    def _gradient_scope(self) -> GradientScope:
        """Which gradient pieces this rank counts in the model's norm: shards by each holder, copies
        (replicas, tensor-parallel replicates) once, each pipeline stage its own, tied copies once."""
        excluded = self._pipeline.excluded_from_norm() if self._pipeline is not None else ()
        return GradientScope(self.device_mesh, stage_dim="pp", excluded=excluded)

    def gradient_norm(self, optimizer: Any, norm_type: float = 2.0) -> Tensor:
        """The norm of the whole model's gradients (every shard, replica and stage), equal on every rank."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        reduce_partial_grads_(params)
        norm = gradient_stats(params, self.precision_plugin.gradient_scope, norm_type).norm
        return torch.tensor(norm, dtype=torch.float64)
