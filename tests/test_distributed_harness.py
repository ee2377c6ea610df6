"""The multi-process harness itself: results, errors and hangs surface with every rank's story."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import DistributedTestError, run_distributed


def _all_reduce_rank(rank: int, world_size: int, scale: int) -> float:
    t = torch.tensor([float(rank * scale)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    # Both ranks joined first: on a loaded machine rank 1 could otherwise raise and close its side
    # while rank 0 was still connecting, and rank 0 would fail in init instead of hanging.
    dist.barrier()
    if rank == 1:
        raise RuntimeError("boom on rank one")
    time.sleep(600)  # rank 0 is stuck somewhere that never notices rank 1 is gone


def _hang_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(600)
    dist.barrier()


def _exit_with_rank_status(rank: int, world_size: int) -> None:
    dist.barrier()
    raise SystemExit(70 + rank)  # as a script's rank ends: StragglerRestart, Preempted


def test_results_come_back_by_rank() -> None:
    assert run_distributed(_all_reduce_rank, 3, 10, timeout=60) == [30.0, 30.0, 30.0]


def test_an_error_on_one_rank_fails_fast_with_its_traceback_and_the_others_stacks() -> None:
    start = time.monotonic()
    with pytest.raises(
        DistributedTestError,
        match=r"(?s)rank 0 did not finish \(hung\).*_raise_on_rank_one.*rank 1 raised.*boom on rank one",
    ):
        run_distributed(_raise_on_rank_one, 2, timeout=60)
    assert time.monotonic() - start < 40


def test_a_rank_that_exits_ends_its_process_with_that_status() -> None:
    with pytest.raises(
        DistributedTestError, match=r"(?s)rank 0 raised.*SystemExit: 70.*rank 1 raised.*SystemExit: 71"
    ) as info:
        run_distributed(_exit_with_rank_status, 2, timeout=60)
    assert info.value.exit_codes == {0: 70, 1: 71}


def test_a_hang_fails_after_the_timeout_with_every_rank_stack() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hang_on_rank_one, 2, timeout=10)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "timed out after 10 s" in message
    # Both ranks' stacks, each pointing at the line it was stuck on.
    assert "rank 0 did not finish (hung)" in message and "rank 1 did not finish (hung)" in message
    assert message.count("_hang_on_rank_one") >= 2
    assert elapsed < 30


def test_no_process_group_leaks_into_the_test_process() -> None:
    run_distributed(_all_reduce_rank, 2, 1, timeout=60)
    assert not dist.is_initialized()
