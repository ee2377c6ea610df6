"""torch's pipeline schedules, built by name over this rank's stages, with two things torch leaves out:
skipping the gradient reduction on accumulation micro-steps, and forward-only evaluation of
V-shaped schedules.

- Gradient accumulation: every schedule step ends with the stage's ``perform_reduce_grad``, which
  turns FSDP2/``replicate`` gradient synchronisation back on and reduces. :class:`GradSyncStage`
  asks a callback first; on a micro-step that is not the last of an accumulation window it lets
  FSDP accumulate the unsharded gradients locally instead (``set_requires_gradient_sync(False)``,
  the FSDP2 form of DDP's ``no_sync``), and the window's last step reduces them all at once.
- torch 2.13's ``eval()`` on V-shaped schedules (ZB-V, DualPipeV) still runs their backward actions
  and fails passing gradients between the two stages of rank 0 ("can't steal_bwd_input").
  :func:`forward_only_schedule` runs a ZB-V schedule whose lowered order keeps only the forward
  actions (and their sends and receives): a subset of a deadlock-free order with only forward
  dependencies, so it cannot deadlock either. The lowered order and its action types are private:
  :func:`~lightning_scale.core.compat.keep_lowered_actions` and
  :func:`~lightning_scale.core.compat.forward_action_types` reach them (as
  :func:`~lightning_scale.core.compat.gradient_sync_held_off` does ``perform_reduce_grad``'s patch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from lightning_scale.core.compat import forward_action_types, gradient_sync_held_off, keep_lowered_actions
from lightning_scale.core.pipeline.partition import SCHEDULES, V_SHAPED

__all__ = ["GradSyncStage", "build_schedule", "forward_only_schedule", "make_stages"]

SINGLE_STAGE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MULTI_STAGE = {
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
assert set(SINGLE_STAGE) | set(MULTI_STAGE) == set(SCHEDULES)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class GradSyncStage(PipelineStage):
    """A ``PipelineStage`` whose end-of-step gradient reduction is skipped while ``sync_grads()`` is false
    and on forward-only steps.

    Only FSDP2 ``fully_shard``/``replicate`` stage modules reduce in ``perform_reduce_grad``; for
    them a skipped step still runs FSDP's post-backward (accumulating the unsharded gradients,
    resharding the parameters), with reduction off.
    """

    def __init__(self, *args: Any, sync_grads: Callable[[], bool], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sync_grads = sync_grads

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        module = self.submod
        # Forward-only steps (evaluation, possibly in the middle of an accumulation window) reduce
        # nothing either: the window's gradients are reduced once, at its end.
        if (self._sync_grads() and self.has_backward) or not isinstance(module, FSDPModule):
            super().perform_reduce_grad(grad_scale_factor)
            return
        # torch's version switches synchronisation on first; keep it off for this one call.
        with gradient_sync_held_off(module):
            super().perform_reduce_grad(grad_scale_factor)


def make_stages(
    modules: Sequence[nn.Module],
    stage_indices: Sequence[int],
    num_stages: int,
    device: torch.device,
    group: ProcessGroup,
    sync_grads: Callable[[], bool] = lambda: True,
) -> list[PipelineStage]:
    """One :class:`GradSyncStage` per local stage (``modules[i]`` runs stage ``stage_indices[i]``)."""
    return [
        GradSyncStage(module, s, num_stages, device, group=group, sync_grads=sync_grads)
        for module, s in zip(modules, stage_indices, strict=True)
    ]


def build_schedule(name: str, stages: Sequence[PipelineStage], microbatches: int, loss_fn: LossFn) -> Any:
    """torch's schedule ``name`` over this rank's stages; gradients are not rescaled (``scale_grads=False``):
    the loss function carries the scale, so gradient accumulation over several steps stays a sum."""
    if name in SINGLE_STAGE:
        if len(stages) != 1:
            raise ValueError(f"schedule={name!r} runs one stage per rank, got {len(stages)}")
        return SINGLE_STAGE[name](stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    if name not in MULTI_STAGE:
        raise ValueError(f"Unknown pipeline schedule {name!r}")
    return MULTI_STAGE[name](list(stages), microbatches, loss_fn=loss_fn, scale_grads=False)


def forward_only_schedule(
    name: str, stages: Sequence[PipelineStage], microbatches: int, loss_fn: LossFn, training_schedule: Any
) -> Any:
    """The schedule to run ``eval()`` with: ``training_schedule`` itself, except for V-shaped schedules,
    which get a ZB-V schedule on ``stages`` (stages of their own) reduced to its forward actions."""
    if name not in V_SHAPED:
        return training_schedule
    schedule = ScheduleZBVZeroBubble(list(stages), microbatches, loss_fn=loss_fn, scale_grads=False)
    keep_lowered_actions(schedule, forward_action_types().__contains__)
    return schedule
