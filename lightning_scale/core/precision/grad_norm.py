"""Global gradient norm over parameters that may be DTensors on different meshes, and clipping by it.

``torch.nn.utils.clip_grad_norm_`` needs all gradients of one kind: a mix of DTensors (sharded by
tensor parallelism) and plain tensors (replicated norms, or modules a plan leaves alone) fails,
and per-rank plain norms would differ across ranks. Here gradients are grouped by their mesh;
each group's norm comes from ``torch.nn.utils.get_total_norm`` (a DTensor norm accounts for
shards and replicas), is made a plain tensor with ``full_tensor()``, and the groups are combined.
Plain gradients are taken to be identical on every rank that holds them (true for replicated
parameters once data-parallel gradients are averaged). Pipeline stages hold disjoint parameters:
pass their process ``group`` and the per-stage norms are combined over it.

:func:`gradient_stats` does the same for a whole (dp, pp, tp) mesh with **one** all-reduce, which
also says whether any gradient anywhere is non-finite: the precision plugin's clipping, logging and
fp16 overflow decision share it. A :class:`GradientScope` says which rank counts which piece.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from lightning_scale.core.compat import foreach_mul_, foreach_norm

__all__ = [
    "GradientScope",
    "GradientStats",
    "clip_grad_norm_",
    "clip_grads_by_value_",
    "gradient_stats",
    "local_grads",
    "model_grad_norm",
    "reduce_partial_grads_",
    "scale_grads_",
    "total_grad_norm",
]


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
    local = (
        torch.linalg.vector_norm(torch.stack(norms), ord=norm_type) if norms else torch.zeros((), dtype=torch.float64)
    )
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


class GradientScope:
    """Which of this rank's gradients count in the whole model's norm, so that one all-reduce over the
    world gives it (and whether any gradient anywhere is non-finite).

    ``mesh`` is the world's device mesh (every rank in it; ``None``: all ranks are replicas, as under
    plain DDP). Along ``stage_dim`` ranks hold different parameters (pipeline stages): every stage
    counts its own. Along every other dimension a piece of a gradient is either a shard (counted by
    each holder) or a copy (a ``Replicate`` placement, a dimension its DTensor's mesh does not span,
    or a plain tensor): a copy counts only on the rank at coordinate 0 of that dimension, so each
    distinct piece is counted exactly once. ``excluded``: ids of parameters another stage already
    counts (a weight tied across stages).

    ``replicated``: every gradient is already the same on every rank, bit for bit (plain DDP after its
    all-reduce: each bucket is reduced once and the same result copied to every rank): each rank takes the
    whole norm from its own gradients, with no collective; the overflow flag is still agreed on when a
    step is decided by it (:func:`gradient_stats`'s ``agree``).

    ``replica_dim``: a dimension whose coordinates are separate models (replicas that step alone between
    synchronisations: a periodic ``data_parallel_sync``): each replica's norm is its own, reduced in its own
    slot of the same all-reduce, while the non-finite flag stays the world's (every replica skips together).
    """

    def __init__(
        self,
        mesh: DeviceMesh | None = None,
        *,
        stage_dim: str | None = None,
        excluded: Iterable[int] = (),
        replica_dim: str | None = None,
        replicated: bool = False,
    ) -> None:
        names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
        for label, dim in (("stage_dim", stage_dim), ("replica_dim", replica_dim)):
            if dim is not None and dim not in names:
                raise ValueError(f"{label}={dim!r} is not a dimension of the mesh {names}.")
        self.mesh = mesh
        self.excluded = frozenset(excluded)
        self._stage = names.index(stage_dim) if stage_dim is not None else None
        self._replica = names.index(replica_dim) if replica_dim is not None else None
        if replicated and replica_dim is not None:
            raise ValueError(
                "replicated=True (one model, gradients averaged) and a replica_dim (separate models) exclude each other."
            )
        self.replicated = replicated
        self._counts: dict[Any, bool] = {}

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The world, when there is more than one process (``None``: nothing to reduce)."""
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        return dist.group.WORLD

    def _world(self) -> tuple[torch.Tensor, list[int]]:
        """The world's ranks as a mesh tensor, and this rank's coordinate in it."""
        if self.mesh is not None:
            coordinate = self.mesh.get_coordinate()
            assert coordinate is not None, "this rank is not in the mesh"
            return self.mesh.mesh, list(coordinate)
        world = dist.get_world_size() if self.group is not None else 1
        rank = dist.get_rank() if self.group is not None else 0
        return torch.arange(world), [rank]

    def counts(self, grad: torch.Tensor) -> bool:
        """Whether this rank counts its piece of ``grad`` (see the class docstring)."""
        if self.replicated:
            return True
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else "plain"
        if key not in self._counts:
            self._counts[key] = self._decide(grad)
        return self._counts[key]

    def _decide(self, grad: torch.Tensor) -> bool:
        ranks, me = self._world()
        spanned: set[int] = set()
        if isinstance(grad, DTensor):
            sub = grad.device_mesh
            for dim, placement in enumerate(grad.placements):
                if placement.is_replicate() and sub.get_local_rank(dim) != 0:
                    return False
            members = set(sub.mesh.flatten().tolist())
            for dim in range(ranks.dim()):
                if ranks.size(dim) > 1:
                    neighbour = list(me)
                    neighbour[dim] = (me[dim] + 1) % ranks.size(dim)
                    if int(ranks[tuple(neighbour)]) in members:
                        spanned.add(dim)
        own = (self._stage, self._replica)
        return all(me[d] == 0 for d in range(ranks.dim()) if d not in own and d not in spanned)

    def replica(self) -> tuple[int, int] | None:
        """(this rank's replica, replicas) along ``replica_dim``; ``None`` without one."""
        if self._replica is None or self.mesh is None:
            return None
        coordinate = self.mesh.get_coordinate()
        assert coordinate is not None, "this rank is not in the mesh"
        return coordinate[self._replica], self.mesh.size(self._replica)


@dataclass(frozen=True)
class GradientStats:
    """The whole model's gradient norm and whether any gradient on any rank is non-finite."""

    norm: float
    """The global ``norm_type``-norm, as a Python float (inf or nan when not finite)."""
    finite: bool
    """False when some rank holds a non-finite gradient (an overflow): equal on every rank."""
    nonfinite_local: tuple[int, ...] = ()
    """Indices (into the parameters passed) of this rank's non-finite gradients."""


def _is_partial(grad: torch.Tensor | None) -> bool:
    return isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements)


def reduce_partial_grads_(parameters: Iterable[torch.Tensor]) -> int:
    """Finish the reduction of gradients left ``Partial`` (e.g. a sequence-parallel norm's weight: each
    tensor-parallel rank holds the sum over its part of the sequence), one bucketed all-reduce per
    mesh dimension instead of one per tensor; each becomes ``Replicate``. Returns the collectives run.

    The optimizer would otherwise reduce each such gradient on its own inside its foreach ops, and a
    norm cannot be taken of a partial sum.
    """
    buckets: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for p in parameters:
        if _is_partial(p.grad):
            buckets.setdefault((p.grad.device_mesh, tuple(p.grad.placements), p.grad.dtype), []).append(p)
    collectives = 0
    for (mesh, placements, _), params in buckets.items():
        locals_ = [p.grad.to_local() for p in params]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                op = placement.reduce_op
                if op not in ("sum", "avg"):
                    raise ValueError(f"Cannot finish a Partial({op}) gradient reduction; only sum and avg.")
                dist.all_reduce(flat, group=mesh.get_group(dim))
                if op == "avg":
                    flat /= mesh.size(dim)
                collectives += 1
        done = [Replicate() if pl.is_partial() else pl for pl in placements]
        offset = 0
        for p, local in zip(params, locals_):
            n = local.numel()
            local.copy_(flat[offset : offset + n].view_as(local))
            offset += n
            p.grad = DTensor.from_local(local, mesh, done, run_check=False, shape=p.grad.shape, stride=p.grad.stride())
    return collectives


def _local(grad: torch.Tensor) -> torch.Tensor:
    if _is_partial(grad):
        raise ValueError(
            "A gradient is still a Partial DTensor (a reduction pending); call reduce_partial_grads_ first."
        )
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _by_kind(pieces: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``pieces`` grouped by (device, dtype): what one foreach call can take."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for j, piece in enumerate(pieces):
        groups.setdefault((piece.device, piece.dtype), []).append(j)
    return groups


def local_grads(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The local tensors of the parameters' gradients (a DTensor's shard), for in-place foreach ops."""
    return [_local(p.grad) for p in parameters if p.grad is not None]


def gradient_stats(
    parameters: Sequence[torch.Tensor], scope: GradientScope, norm_type: float = 2.0, *, agree: bool = True
) -> GradientStats:
    """The global gradient norm and the overflow flag from **one** all-reduce of two numbers.

    Gradients must not be ``Partial`` (:func:`reduce_partial_grads_`). Each rank takes the norms of
    its local gradient pieces (foreach, per device and dtype), sums the ``norm_type``-th powers of the
    pieces ``scope`` counts (max for the inf-norm), and flags any non-finite piece, counted or not;
    one all-reduce over the world combines both. Reading the result is the step's one host
    synchronisation.
    """
    if not (norm_type == float("inf") or norm_type > 0):
        raise ValueError(f"norm_type={norm_type} must be positive or inf.")
    with_grads = [(i, p) for i, p in enumerate(parameters) if p.grad is not None]
    grads = [p.grad for _, p in with_grads]
    pieces = [_local(g) for g in grads]  # type: ignore[arg-type]
    device = pieces[0].device if pieces else torch.device("cpu")
    norms = torch.zeros(len(pieces), dtype=torch.float64, device=device)
    for (_, dtype), members in _by_kind(pieces).items():
        # Half-precision gradients are summed in fp32 at least.
        accumulate = torch.promote_types(dtype, torch.float32)
        found = foreach_norm([pieces[j] for j in members], norm_type, dtype=accumulate)
        norms[members] = torch.stack(found).to(device=device, dtype=torch.float64)
    counts = [scope.counts(g) and id(p) not in scope.excluded for g, (_, p) in zip(grads, with_grads)]  # type: ignore[arg-type]
    counted = torch.tensor(counts, device=device, dtype=torch.bool)
    inf_norm = norm_type == float("inf")
    chosen = norms[counted] if pieces else norms
    value = (chosen.max() if chosen.numel() else norms.new_zeros(())) if inf_norm else (chosen**norm_type).sum()
    flag = (~torch.isfinite(norms)).any().to(torch.float64)
    replica = scope.replica()
    if replica is None:
        both = torch.stack([value, flag])
    else:  # one slot per replica: each replica's norm is its own
        both = torch.zeros(replica[1] + 1, dtype=torch.float64, device=device)
        both[replica[0]], both[-1] = value, flag
    group = scope.group
    if group is not None and scope.replicated:
        # Each rank holds the whole (same) norm; only a decision on it (``agree``) takes the flag's collective,
        # so that a gradient made non-finite on one rank after DDP's reduction still skips the step everywhere.
        if agree:
            dist.all_reduce(both[-1:], op=dist.ReduceOp.MAX, group=group)
    elif group is not None:
        dist.all_reduce(both, op=dist.ReduceOp.MAX if inf_norm else dist.ReduceOp.SUM, group=group)
    values = both.tolist()
    total, nonfinite = (values[replica[0]] if replica is not None else values[0]), values[-1]
    norm = total if inf_norm else total ** (1.0 / norm_type)
    finite = nonfinite == 0 and math.isfinite(norm)
    if not finite and math.isfinite(norm):
        norm = math.inf  # the non-finite piece was a copy another rank counts (replicas that diverged)
    local_bad: tuple[int, ...] = ()
    if not finite:
        local_bad = tuple(with_grads[j][0] for j in (~torch.isfinite(norms)).nonzero().flatten().tolist())
    return GradientStats(norm=norm, finite=finite, nonfinite_local=local_bad)


def model_grad_norm(parameters: Sequence[torch.Tensor], scope: GradientScope, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole model's gradients (every shard, replica and stage; ``scope`` says which
    rank counts which piece), a float64 scalar equal on every rank. Gradients left ``Partial`` are
    reduced first (:func:`reduce_partial_grads_`)."""
    reduce_partial_grads_(parameters)
    return torch.tensor(gradient_stats(parameters, scope, norm_type).norm, dtype=torch.float64)


def scale_grads_(parameters: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every gradient in place by ``factor`` (each local shard; foreach per device and dtype)."""
    if factor == 1.0:
        return
    pieces = local_grads(parameters)
    for members in _by_kind(pieces).values():
        foreach_mul_([pieces[j] for j in members], factor)


def clip_grads_by_value_(parameters: Iterable[torch.Tensor], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` (local shards: elementwise, no communication)."""
    for piece in local_grads(parameters):
        piece.clamp_(-clip_value, clip_value)
