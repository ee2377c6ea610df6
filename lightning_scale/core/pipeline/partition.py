"""Cutting an ordered list of blocks into pipeline stages, and what a cut will cost.

Blocks stay in order and every stage gets a contiguous, non-empty run of them. The first stage
also carries what runs before the first block (embeddings), the last stage what runs after the
last block (final norm, output head, loss): ``first_cost`` and ``last_cost``.

- ``by_layers``: equal numbers of blocks (the earlier stages take one more when they do not divide).
- ``by_params`` / ``by_cost``: minimise the largest stage total of per-block weights (parameter
  counts, or measured forward+backward seconds). Exact, by dynamic programming over cut points:
  ``O(stages * blocks^2)``, instant for any real model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_scale.core.checks import format_choices

__all__ = [
    "SCHEDULES",
    "Partition",
    "balanced_partition",
    "bubble_fraction",
    "check_schedule_microbatches",
    "check_stage_blocks",
    "partition_by_layers",
    "stage_ranks",
    "stages_per_rank",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")
"""Schedule names; the interleaved and V-shaped ones run several (virtual) stages per rank."""

STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "zbv": 2, "dualpipev": 2}
"""Fixed stages per rank; interleaved schedules take ``virtual_stages`` (2 or more)."""

V_SHAPED = ("zbv", "dualpipev")
"""Schedules that place stages ``r`` and ``2p - 1 - r`` on rank ``r`` (the first and last stage share rank 0)."""


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """Stages each rank runs: 1 for GPipe/1F1B, 2 for the V-shaped ones, ``virtual_stages`` when interleaved."""
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown pipeline schedule {schedule!r}. Valid schedules: {format_choices(SCHEDULES)}.")
    if schedule.startswith("interleaved") and virtual_stages < 2:
        raise ValueError(
            f"schedule={schedule!r} runs several stages per rank; set virtual_stages >= 2 (got {virtual_stages})."
        )
    return STAGES_PER_RANK.get(schedule, virtual_stages)


def stage_ranks(schedule: str, pipeline_parallel: int, num_stages: int) -> list[int]:
    """The pipeline rank of each stage: round robin (``s % p``), or V-shaped (``s`` then ``2p - 1 - s``)."""
    p = pipeline_parallel
    if schedule in V_SHAPED:
        return [s if s < p else 2 * p - 1 - s for s in range(num_stages)]
    return [s % p for s in range(num_stages)]


def check_schedule_microbatches(schedule: str, pipeline_parallel: int, microbatches: int) -> None:
    """The micro-batch counts torch's schedules accept, checked before any work with the fix named."""
    p, m = pipeline_parallel, microbatches
    if p == 1:
        return
    if schedule == "1f1b" and m < p:
        raise ValueError(
            f"schedule='1f1b' needs at least as many micro-batches as stages: microbatches={m} < "
            f"pipeline_parallel={p}. Use microbatches >= {p}, or schedule='gpipe'."
        )
    if schedule.startswith("interleaved"):
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(
                f"schedule={schedule!r} runs micro-batches in rounds of pipeline_parallel={p}: microbatches={m} must "
                f"be below {p} or a multiple of the {rounds} rounds. Use microbatches {rounds * (m // rounds)} or "
                f"{p * (m // p + 1)}."
            )
    if schedule == "dualpipev" and m < 2 * p:
        raise ValueError(
            f"schedule='dualpipev' needs at least as many micro-batches as stages (2 x pipeline_parallel = {2 * p}); "
            f"got microbatches={m}. Use microbatches >= {2 * p}."
        )


@dataclass(frozen=True)
class Partition:
    """Stage ``i`` runs blocks ``ranges[i][0] <= b < ranges[i][1]``; ``costs[i]`` includes first/last extras."""

    ranges: tuple[tuple[int, int], ...]
    costs: tuple[float, ...]

    @property
    def slowest(self) -> float:
        return max(self.costs)

    def blocks(self, stage: int) -> range:
        return range(*self.ranges[stage])


def _stage_costs(
    ranges: Sequence[tuple[int, int]], weights: Sequence[float], first_cost: float, last_cost: float
) -> tuple[float, ...]:
    costs = [float(sum(weights[a:b])) for a, b in ranges]
    costs[0] += first_cost
    costs[-1] += last_cost
    return tuple(costs)


def _check(num_blocks: int, stages: int) -> None:
    if stages < 1:
        raise ValueError(f"The number of pipeline stages must be positive, got {stages}")
    if num_blocks < stages:
        raise ValueError(
            f"Cannot cut {num_blocks} blocks into {stages} pipeline stages: every stage needs at least one block. "
            f"Use at most {num_blocks} stages (pipeline_parallel x stages per rank), or a model with more blocks."
        )


def partition_by_layers(
    num_blocks: int,
    stages: int,
    weights: Sequence[float] | None = None,
    first_cost: float = 0.0,
    last_cost: float = 0.0,
) -> Partition:
    """Equal block counts; ``weights`` (default 1 per block) only fill in the reported costs."""
    _check(num_blocks, stages)
    weights = [1.0] * num_blocks if weights is None else weights
    base, extra = divmod(num_blocks, stages)
    ranges, start = [], 0
    for stage in range(stages):
        end = start + base + (1 if stage < extra else 0)
        ranges.append((start, end))
        start = end
    return Partition(tuple(ranges), _stage_costs(ranges, weights, first_cost, last_cost))


def balanced_partition(
    weights: Sequence[float], stages: int, first_cost: float = 0.0, last_cost: float = 0.0
) -> Partition:
    """Contiguous cut minimising the largest stage cost (ties: the earliest cut points)."""
    n = len(weights)
    _check(n, stages)
    if any(w < 0 for w in weights) or first_cost < 0 or last_cost < 0:
        raise ValueError("Stage costs must be non-negative")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))

    def seg(a: int, b: int, stage: int) -> float:
        cost = prefix[b] - prefix[a]
        if stage == 0:
            cost += first_cost
        if stage == stages - 1:
            cost += last_cost
        return cost

    inf = float("inf")
    # best[s][b]: smallest possible max stage cost with stages 0..s covering blocks [0, b).
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for b in range(1, n - stages + 2):
        best[0][b] = seg(0, b, 0)
    for s in range(1, stages):
        for b in range(s + 1, n - (stages - 1 - s) + 1):
            for a in range(s, b):
                value = max(best[s - 1][a], seg(a, b, s))
                if value < best[s][b] - 1e-12:
                    best[s][b], cut[s][b] = value, a
    ranges, end = [], n
    for s in range(stages - 1, -1, -1):
        start = cut[s][end] if s else 0
        ranges.append((start, end))
        end = start
    ranges.reverse()
    return Partition(tuple(ranges), _stage_costs(ranges, weights, first_cost, last_cost))


def bubble_fraction(schedule: str, pipeline_parallel: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Predicted idle share of a step for balanced stages, from the schedules' papers.

    - GPipe and 1F1B: ``(p - 1) / (m + p - 1)`` (Huang et al. 2019; Narayanan et al. 2019).
    - Interleaved 1F1B with ``v`` stages per rank: ``(p - 1) / (v*m + p - 1)`` (Narayanan et al. 2021).
    - Zero-bubble schedules split the backward into input and weight gradients and fill the
      bubble with the latter: about a third of 1F1B's for the interleaved ZB-H1 form, and close to
      zero for the V-shaped ZB-V and DualPipeV once ``m >= 2p`` (Qi et al. 2023); reported as
      ``(p - 1) / (3 (v*m + p - 1))`` and ``max(0, p - 1 - m) / (v*m + p - 1)`` respectively.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown pipeline schedule {schedule!r}. Valid schedules: {format_choices(SCHEDULES)}.")
    p, m, v = pipeline_parallel, microbatches, virtual_stages
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline_parallel, microbatches and virtual_stages must be positive, got {p}, {m}, {v}")
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "interleaved_zero_bubble":
        return (p - 1) / (3 * (v * m + p - 1))
    return max(0, p - 1 - m) / (v * m + p - 1)


def check_stage_blocks(*, num_blocks: int, pipeline_parallel: int, schedule: str, virtual_stages: int) -> int:
    """Check that ``num_blocks`` can be cut into the schedule's stages; returns the stages per rank."""
    per_rank = stages_per_rank(schedule, virtual_stages)
    stages = pipeline_parallel * per_rank
    if num_blocks < stages:
        raise ValueError(
            f"pipeline_parallel={pipeline_parallel} with {per_rank} stage(s) per rank needs {stages} blocks, but the "
            f"model declares {num_blocks}. Lower pipeline_parallel (at most {max(num_blocks // per_rank, 1)}) or "
            "use a deeper model."
        )
    if per_rank > 1 and num_blocks % stages:
        raise ValueError(
            f"schedule={schedule!r} places {per_rank} stages on each of {pipeline_parallel} ranks: the {num_blocks} "
            f"blocks must divide into {stages} equal stages. Use a model with a multiple of {stages} blocks or "
            "another pipeline_parallel/virtual_stages."
        )
    return per_rank
