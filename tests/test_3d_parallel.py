"""3D parallelism: dp x tp x pp together, FSDP2 modes on the data-parallel axis; parity with one process."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.distributed import run_distributed
from helpers.parity import assert_parity, fit_gpt

import lightning_scale  # noqa: F401
from lightning_scale.models import GPTConfig
from lightning_scale.strategies import HybridParallelStrategy

STEPS = 10
CONFIG = GPTConfig(n_layers=4, d_model=64, n_heads=4, block_size=32, tie_embeddings=False)


def _hybrid(rank: int, world: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    return fit_gpt(HybridParallelStrategy(**kwargs), world, CONFIG, steps=STEPS)


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return fit_gpt("auto", 1, CONFIG, steps=STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_dp2_tp2_pp2_matches_one_process(single: dict[str, Any], mode: str) -> None:
    kwargs = {"data_parallel": 2, "tensor_parallel": 2, "pipeline_parallel": 2, "data_parallel_mode": mode, "microbatches": 2}
    assert_parity(run_distributed(_hybrid, 8, kwargs, timeout=420), single)


@pytest.mark.slow
def test_dp2_pp2_fsdp_grad_op_matches_one_process(single: dict[str, Any]) -> None:
    kwargs = {"data_parallel": 2, "pipeline_parallel": 2, "data_parallel_mode": "fsdp_grad_op", "microbatches": 2}
    assert_parity(run_distributed(_hybrid, 4, kwargs, timeout=300), single)


@pytest.mark.slow
def test_dp4_hsdp_2x2_matches_one_process(single: dict[str, Any]) -> None:
    kwargs = {"data_parallel": 4, "data_parallel_mode": "hsdp", "hsdp_replicate": 2, "hsdp_shard": 2}
    assert_parity(run_distributed(_hybrid, 4, kwargs, timeout=300), single)
