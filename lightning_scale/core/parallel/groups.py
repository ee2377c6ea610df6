"""Questions about process groups that hold with or without one: is this distributed, this rank,
the group's size, everybody's value. Code that runs both in a single process and on a world
(checkpoint save and load, telemetry) asks these instead of ``torch.distributed`` directly.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["distributed", "gather_objects", "group_rank", "group_size"]


def distributed(group: dist.ProcessGroup | None) -> bool:
    """True when ``group`` (None: the world) spans more than this process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 without one)."""
    return dist.get_rank(group) if distributed(group) else 0


def group_size(group: dist.ProcessGroup | None) -> int:
    """How many processes ``group`` spans (1 without one)."""
    return dist.get_world_size(group) if distributed(group) else 1


def gather_objects(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``value`` in rank order (``[value]`` without a group), by ``all_gather_object``."""
    if not distributed(group):
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out
