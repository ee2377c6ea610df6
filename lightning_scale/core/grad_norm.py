"""Global gradient norm over parameters that may be DTensors on different meshes, and clipping by it.

``torch.nn.utils.clip_grad_norm_`` needs all gradients of one kind: a mix of DTensors (sharded by
tensor parallelism) and plain tensors (replicated norms, or modules a plan leaves alone) fails,
and per-rank plain norms would differ across ranks. Here gradients are grouped by their mesh;
each group's norm comes from ``torch.nn.utils.get_total_norm`` (a DTensor norm accounts for
shards and replicas), is made a plain tensor with ``full_tensor()``, and the groups are combined.
Plain gradients are taken to be identical on every rank that holds them (true for replicated
parameters once data-parallel gradients are averaged). Pipeline stages hold disjoint parameters:
pass their process ``group`` and the per-stage norms are combined over it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def _groups(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    by_key: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else ("plain", g.device, g.dtype)
        by_key.setdefault(key, []).append(g)
    return list(by_key.values())


def total_grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The norm of all gradients together (over ``group`` too, if given), a plain scalar equal on every rank."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norms = []
    for same_kind in _groups(grads):
        norm = torch.nn.utils.get_total_norm(same_kind, norm_type=norm_type)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        norms.append(norm.to(dtype=torch.float64))
    local = torch.linalg.vector_norm(torch.stack(norms), ord=norm_type) if norms else torch.zeros((), dtype=torch.float64)
    if group is None or dist.get_world_size(group) == 1:
        return local
    if norm_type == float("inf"):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    powered = local**norm_type
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return powered ** (1.0 / norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
    norm_parameters: Iterable[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Scale all gradients so their global norm is at most ``max_norm``; returns the norm before clipping.

    ``norm_parameters`` (default: ``parameters``) are the ones counted in the norm: leave out a copy
    of a parameter that another rank of ``group`` already counts (a tied weight split over stages).
    """
    params = [p for p in parameters if p.grad is not None]
    counted = params if norm_parameters is None else [p for p in norm_parameters if p.grad is not None]
    total = total_grad_norm(counted, norm_type, group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # DTensor grads take a Python scalar (a plain tensor would not mix with them): read it once.
    coef_value = float(coef) if any(isinstance(p.grad, DTensor) for p in params) else None
    for p in params:
        assert p.grad is not None
        p.grad.mul_(coef_value if isinstance(p.grad, DTensor) else coef.to(p.grad))
    return total
