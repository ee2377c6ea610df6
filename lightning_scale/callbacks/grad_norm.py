"""``GradNormMonitor``: the global gradient norm before every optimizer step, as ``train/grad_norm``."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_scale._lightning_hooks import restore_hooks, skip_hooks
from lightning_scale.core.precision.grad_norm import total_grad_norm
from lightning_scale.plugins.precision import MixedPrecision

__all__ = ["GradNormMonitor"]


class GradNormMonitor(Callback):
    """Log the norm of all gradients (before clipping) as ``train/grad_norm``.

    Under ``HybridParallelStrategy`` the norm is the model's, not a rank's: over tensor-parallel
    and FSDP shards, data-parallel replicas and every pipeline stage, with a weight tied across
    stages counted once; it equals the single-process norm. With
    :class:`~lightning_scale.plugins.MixedPrecision` (always, under ``HybridParallelStrategy``) and
    the plugin's ``norm_type``, the plugin logs it from the one all-reduce per optimizer step that
    clipping and the overflow decision share: after the ``on_before_optimizer_step`` hooks, on the
    unscaled gradients. Otherwise it is taken here, in ``on_before_optimizer_step``: under other
    strategies, the norm of the gradients this rank holds. Every rank takes part, rank 0's loggers
    write it.

    Args:
        norm_type: the p of the p-norm (``float("inf")`` for the largest absolute value).
    """

    def __init__(self, norm_type: float = 2.0) -> None:
        if not (norm_type == float("inf") or norm_type > 0):
            raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
        self.norm_type = float(norm_type)
        self._delegated = False

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        restore_hooks(self)
        plugin = trainer.precision_plugin
        self._delegated = isinstance(plugin, MixedPrecision) and plugin.norm_type == self.norm_type
        if self._delegated:
            plugin.log_grad_norm = True
            skip_hooks(self, ["on_before_optimizer_step"])  # nothing to do per step: not dispatched (nor by a group)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._delegated:
            return
        norm_fn = getattr(trainer.strategy, "gradient_norm", None)
        if callable(norm_fn):
            norm = norm_fn(optimizer, self.norm_type)
        else:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            norm = total_grad_norm(params, self.norm_type)
        pl_module.log("train/grad_norm", norm.to(torch.float32), on_step=True, on_epoch=False)
