"""The world's process group, and the collectives Lightning asks a strategy for (``barrier``,
``broadcast``, ``reduce``) over it; each is a no-op (returns its input) before the group exists."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import group as _group
from torch import Tensor

from lightning_scale._lightning_compat import init_dist_connection
from lightning_scale.core.parallel.process_groups import end_at_exit

__all__ = ["barrier", "broadcast", "default_backend", "elastic_attempt_store", "init_world", "reduce"]


def init_world(environment: ClusterEnvironment, backend: str, world_size: int, timeout: Any) -> None:
    """The world's process group, as Lightning's strategies make it (under torchrun's restarts, on a
    store of this attempt's own: :func:`elastic_attempt_store`), ended when the process exits
    (:func:`~lightning_scale.core.parallel.process_groups.end_at_exit`)."""
    kwargs: dict[str, Any] = {"timeout": timeout}
    store = elastic_attempt_store(world_size, timeout)
    if store is not None:
        kwargs["store"] = store
    init_dist_connection(environment, backend, **kwargs)
    end_at_exit()  # whoever made the group: the meshes this strategy builds hold groups of their own


def default_backend(device: torch.device) -> str:
    """The process group backend torch pairs with ``device``'s type (CUDA: NCCL), else gloo."""
    return dist.Backend.default_device_backend_map.get(device.type, "gloo")


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()  # `is_initialized` exists only where `is_available()`


def barrier(device: torch.device | None) -> None:
    """Every rank waits for the others (NCCL: on ``device``, this rank's GPU)."""
    if not _initialized():
        return
    if dist.get_backend() == "nccl":
        assert device is not None
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (any picklable object), on every rank."""
    if not _initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src, group=_group.WORLD)
    return box[0]


def reduce(tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
    """``tensor`` all-reduced in place over ``group`` (default: the world) with ``reduce_op`` (a
    ``ReduceOp`` or its name; ``"mean"``/``"avg"``: the sum divided by the group's size); anything
    that is not a tensor is returned as it is.

    Over the world: tensor- and pipeline-parallel ranks of a replica log equal values, so the world
    mean is the data-parallel mean. Unlike Lightning's helper, no barrier before the all-reduce (the
    all-reduce synchronises already)."""
    if not isinstance(tensor, Tensor) or not _initialized():
        return tensor
    group = _group.WORLD if group is None else group
    mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
    if isinstance(reduce_op, str) and not mean:
        op = getattr(dist.ReduceOp, reduce_op.upper())
    else:
        op = dist.ReduceOp.SUM if mean or reduce_op is None else reduce_op
    dist.all_reduce(tensor, op=op, group=group)
    if mean:
        size = dist.get_world_size(group)
        return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)
    return tensor


def elastic_attempt_store(world_size: int, timeout: Any) -> Any:
    """Under torchrun, the process group's store for this attempt: the agent's store, with a prefix per restart.

    torchrun keeps one store (``MASTER_PORT``) across ``--max-restarts`` relaunches and, with its agent
    store, adds no per-attempt prefix: a relaunched rank can read the address a dead rank of the previous
    attempt published and fail to connect (gloo: "Connection refused"). ``None`` outside torchrun.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    kwargs = {"timeout": timeout} if timeout is not None else {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, **kwargs
    )
    return dist.PrefixStore(f"lightning_scale/attempt_{restart}", store)
