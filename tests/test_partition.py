"""Pipeline partitioning and shape checks: pure functions, checked against brute force and papers."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_scale.core.pipeline.partition import (
    SCHEDULES,
    balanced_partition,
    bubble_fraction,
    check_schedule_microbatches,
    check_stage_blocks,
    partition_by_layers,
    stage_ranks,
)


def test_by_layers_splits_evenly_with_earlier_stages_taking_the_remainder() -> None:
    part = partition_by_layers(10, 4, first_cost=2.0, last_cost=1.0)
    assert part.ranges == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert part.costs == (5.0, 3.0, 2.0, 3.0)


def _brute_force(weights: list[float], stages: int, first: float, last: float) -> float:
    n, best = len(weights), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        costs = [sum(weights[a:b]) for a, b in itertools.pairwise(bounds)]
        costs[0] += first
        costs[-1] += last
        best = min(best, max(costs))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_partition_is_optimal(seed: int) -> None:
    rng = random.Random(seed)
    n, stages = rng.randint(2, 9), rng.randint(1, 4)
    stages = min(stages, n)
    weights = [rng.uniform(0.1, 5.0) for _ in range(n)]
    first, last = rng.uniform(0, 3), rng.uniform(0, 3)
    part = balanced_partition(weights, stages, first, last)
    assert part.slowest == pytest.approx(_brute_force(weights, stages, first, last))
    assert [b for s in range(stages) for b in part.blocks(s)] == list(range(n))  # ordered, complete, non-empty
    assert all(b > a for a, b in part.ranges)


def test_by_cost_beats_by_layers_on_unequal_blocks() -> None:
    # Known costs: one heavy block in the first half, a heavy head on the last stage.
    weights = [1.0, 6.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    by_layers = partition_by_layers(len(weights), 2, weights, first_cost=0.5, last_cost=3.0)
    by_cost = balanced_partition(weights, 2, first_cost=0.5, last_cost=3.0)
    assert by_layers.costs == (9.5, 7.0)
    assert by_cost.slowest <= by_layers.slowest and by_cost.slowest == 8.5


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v", "expected"),
    [
        ("gpipe", 2, 4, 1, 1 / 5),
        ("1f1b", 4, 8, 1, 3 / 11),
        ("interleaved_1f1b", 4, 8, 2, 3 / 19),
        ("interleaved_zero_bubble", 4, 8, 2, 1 / 19),
        ("zbv", 4, 8, 2, 0.0),
        ("zbv", 4, 2, 2, 1 / 7),
        ("1f1b", 1, 8, 1, 0.0),
    ],
)
def test_bubble_fraction_golden_values(schedule: str, p: int, m: int, v: int, expected: float) -> None:
    assert bubble_fraction(schedule, p, m, v) == pytest.approx(expected)


def test_bubble_shrinks_with_more_microbatches() -> None:
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        values = [bubble_fraction(schedule, 4, m, 2) for m in (2, 4, 8, 16)]
        assert values == sorted(values, reverse=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"schedule": "pipedream"},
            r"Unknown pipeline schedule 'pipedream'. Valid schedules: '1f1b', 'dualpipev', 'gpipe'",
        ),
        (
            {"pipeline_parallel": 8},
            r"pipeline_parallel=8 with 1 stage\(s\) per rank needs 8 blocks, but the model declares 4",
        ),
        (
            {"schedule": "interleaved_1f1b", "virtual_stages": 3, "num_blocks": 8},
            r"the 8 blocks must divide into 6 equal stages",
        ),
        ({"schedule": "interleaved_1f1b", "virtual_stages": 1}, r"set virtual_stages >= 2"),
        ({"schedule": "zbv", "num_blocks": 3}, r"needs 4 blocks, but the model declares 3"),
    ],
)
def test_pipeline_shape_errors(kwargs: dict, match: str) -> None:
    # (Micro-batches that do not divide the batch are refused by the runner: test_core_pipeline_runner.py.)
    base = {"num_blocks": 4, "pipeline_parallel": 2, "schedule": "1f1b", "virtual_stages": 1}
    with pytest.raises(ValueError, match=match):
        check_stage_blocks(**(base | kwargs))


def test_pipeline_shape_accepts_valid_layouts() -> None:
    assert check_stage_blocks(num_blocks=8, pipeline_parallel=2, schedule="interleaved_1f1b", virtual_stages=2) == 2
    check_schedule_microbatches("interleaved_1f1b", 2, 8)
    assert check_stage_blocks(num_blocks=4, pipeline_parallel=2, schedule="zbv", virtual_stages=1) == 2
    check_schedule_microbatches("zbv", 2, 2)
    assert check_stage_blocks(num_blocks=4, pipeline_parallel=4, schedule="1f1b", virtual_stages=1) == 1
    assert set(SCHEDULES) >= {"gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev"}


def test_stage_ranks_round_robin_and_v_shape() -> None:
    assert stage_ranks("interleaved_1f1b", 2, 4) == [0, 1, 0, 1]
    assert stage_ranks("zbv", 2, 4) == [0, 1, 1, 0]
    assert stage_ranks("dualpipev", 4, 8) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert stage_ranks("1f1b", 4, 4) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("schedule", "p", "m", "ok"),
    [
        ("1f1b", 4, 4, True),
        ("1f1b", 4, 3, False),
        ("gpipe", 4, 1, True),
        ("interleaved_1f1b", 4, 9, False),
        ("interleaved_1f1b", 4, 10, True),
        ("interleaved_1f1b", 4, 12, True),
        ("interleaved_1f1b", 4, 3, True),
        ("dualpipev", 2, 3, False),
        ("dualpipev", 2, 4, True),
    ],
)
def test_schedule_microbatch_rules(schedule: str, p: int, m: int, ok: bool) -> None:
    if ok:
        check_schedule_microbatches(schedule, p, m)
    else:
        with pytest.raises(ValueError, match=r"microbatches"):
            check_schedule_microbatches(schedule, p, m)
