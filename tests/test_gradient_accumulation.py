"""Gradient accumulation under FSDP2 (``fsdp``, ``replicate``), with and without a pipeline: gradients
are reduced over the replicas once per optimizer step, not once per micro-step, and the losses
still equal one process's."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.distributed import run_distributed
from helpers.parity import assert_parity, fit_gpt, single_process
from helpers.profiling import CountEvents
from lightning.pytorch import Callback
from torch.distributed.fsdp import FSDPModule

import lightning_scale  # noqa: F401
from lightning_scale.models import GPTConfig
from lightning_scale.strategies import HybridParallelStrategy

CONFIG = GPTConfig(n_layers=4, d_model=32, n_heads=2, block_size=16, tie_embeddings=False)
TIED = GPTConfig(n_layers=4, d_model=32, n_heads=2, block_size=16, tie_embeddings=True)
STEPS, ACCUMULATE = 4, 2
REDUCE, REDUCE_SCATTER = "FSDP::post_backward_reduce", "c10d::_reduce_scatter_base_"


def _param_groups(module: Any) -> int:
    """FSDP units holding parameters of their own: each reduces its gradients once per reduction."""

    def own(unit: Any) -> bool:
        nested = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
        return any(id(p) not in nested for p in unit.parameters())

    return sum(1 for m in module.modules() if isinstance(m, FSDPModule) and own(m))


class _Groups(Callback):
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.groups = _param_groups(pl_module)


def _accumulate(rank: int, world: int, layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for kwargs in layouts:
        count, groups = CountEvents([REDUCE, REDUCE_SCATTER]), _Groups()
        config = TIED if kwargs.pop("tied", False) else CONFIG
        strategy = HybridParallelStrategy(microbatches=2, **kwargs)
        result = fit_gpt(strategy, world, config, steps=STEPS, accumulate=ACCUMULATE, callbacks=[count, groups])
        result["counts"], result["groups"] = count.counts, groups.groups
        results.append(result)
    return results


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return single_process(CONFIG, steps=STEPS, accumulate=ACCUMULATE)


def _check(results: list[dict[str, Any]], reference: dict[str, Any], mode: str) -> None:
    for result in results:
        assert_parity([result], reference, rtol=1e-9)
        assert len(result["counts"]) == STEPS and result["groups"] > 0
        for step in result["counts"]:
            # One reduction per FSDP unit per optimizer step (twice as many if every micro-step reduced).
            assert step[REDUCE] == result["groups"], (step, result["groups"])
            if mode in ("fsdp", "hsdp"):  # sharded: one reduce-scatter per unit (hsdp all-reduces it after)
                assert step[REDUCE_SCATTER] == result["groups"], (step, result["groups"])


@pytest.mark.slow
def test_fsdp_modes_at_dp2_reduce_once_per_optimizer_step(single: dict[str, Any]) -> None:
    layouts = [{"data_parallel": 2, "data_parallel_mode": mode} for mode in ("fsdp", "fsdp_grad_op")]
    fsdp, grad_op = zip(*run_distributed(_accumulate, 2, layouts, timeout=240))
    _check(list(fsdp), single, "fsdp")
    _check(list(grad_op), single, "fsdp")


@pytest.mark.slow
def test_fsdp_and_replicate_under_a_pipeline_and_hsdp_reduce_once_per_optimizer_step(single: dict[str, Any]) -> None:
    layouts: list[dict[str, Any]] = [
        {"data_parallel": 2, "pipeline_parallel": 2, "data_parallel_mode": m} for m in ("fsdp", "ddp")
    ]
    layouts.append({"data_parallel": 4, "data_parallel_mode": "hsdp", "hsdp_replicate": 2, "hsdp_shard": 2})
    # The embedding and head tied across the stages: sharded copies, summed over the stages once a window.
    layouts.append({"data_parallel": 2, "pipeline_parallel": 2, "data_parallel_mode": "fsdp", "tied": True})
    fsdp, replicate, hsdp, tied = zip(*run_distributed(_accumulate, 4, layouts, timeout=420))
    _check(list(fsdp), single, "fsdp")
    _check(list(replicate), single, "ddp")  # FSDP2's replicate (with a pipeline): all-reduces
    _check(list(hsdp), single, "hsdp")
    _check(list(tied), single_process(TIED, steps=STEPS, accumulate=ACCUMULATE), "fsdp")
