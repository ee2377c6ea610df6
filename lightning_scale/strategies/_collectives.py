"""The collectives Lightning asks a strategy for (``barrier``, ``broadcast``, ``reduce``), over the world."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.distributed import group as _group
from torch import Tensor

__all__ = ["WorldCollectives"]


class WorldCollectives:
    """Mixin for a ``ParallelStrategy`` with a ``root_device``."""

    root_device: torch.device

    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # Over the world: tensor- and pipeline-parallel ranks of a replica log equal values,
        # so the world mean is the data-parallel mean. Unlike Lightning's helper, no barrier
        # before the all-reduce (the all-reduce synchronises already).
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        group = _group.WORLD if group is None else group
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if isinstance(reduce_op, str) and not mean:
            op = getattr(torch.distributed.ReduceOp, reduce_op.upper())
        else:
            op = torch.distributed.ReduceOp.SUM if mean or reduce_op is None else reduce_op
        torch.distributed.all_reduce(tensor, op=op, group=group)
        if mean:
            size = torch.distributed.get_world_size(group)
            return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)
        return tensor
