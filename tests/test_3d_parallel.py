"""3D parallelism: dp x tp x pp together, FSDP2 modes on the data-parallel axis; parity with one process.

The runs of one world size share one spawn (a module fixture); each test checks its own case.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch
from helpers.distributed import run_cases, run_distributed
from helpers.lightning import fit_error, quiet_trainer
from helpers.models import BlockStack, StackModule
from helpers.parity import STEPS, RecordLoss, assert_parity, fit_gpt, single_process
from helpers.profiling import CountEvents
from lightning.pytorch import Callback, LightningModule, seed_everything

import lightning_scale  # noqa: F401
from lightning_scale.callbacks import Throughput
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.strategies import HybridParallelStrategy

CONFIG = GPTConfig(n_layers=4, d_model=32, n_heads=2, block_size=16, tie_embeddings=False)
TIED = GPTConfig(n_layers=4, d_model=32, n_heads=2, block_size=16, tie_embeddings=True)


def _gathers_per_step(world: int, microbatches: int) -> int:
    """FSDP all-gathers in the second training step at dp=2 x pp=2."""
    seed_everything(0, verbose=False)
    count = CountEvents(["all_gather"])
    strategy = HybridParallelStrategy(
        data_parallel=2, pipeline_parallel=2, data_parallel_mode="fsdp", microbatches=microbatches
    )
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=2, callbacks=[count])
    trainer.fit(GPTLightningModule(CONFIG), datamodule=TextDataModule(seq_len=16, global_batch_size=16))
    return count.counts[-1]["all_gather"]


def _tied_v_error(world: int) -> str:
    strategy = HybridParallelStrategy(data_parallel=2, pipeline_parallel=2, schedule="zbv", microbatches=2)
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=1)
    return fit_error(trainer, GPTLightningModule(TIED), datamodule=TextDataModule(seq_len=16, global_batch_size=4))


class _UnevenBlock(torch.nn.Module):
    """Slow (50 ms) on one block, fast elsewhere; which block is slow depends on the data-parallel replica."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        replica = torch.distributed.get_rank() // 2  # (dp, pp, tp) = (2, 2, 1): ranks 0-1, then 2-3
        time.sleep(0.05 if self.index == (0 if replica == 0 else 3) else 0.002)
        return self.linear(x)


def _by_cost_cut(world: int) -> tuple[tuple[int, int], ...]:
    """The by_cost cut at dp=2 x pp=2 when the replicas time their blocks differently."""
    strategy = HybridParallelStrategy(data_parallel=2, pipeline_parallel=2, microbatches=2, partition="by_cost")
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=1)
    uneven = StackModule(BlockStack([_UnevenBlock(i) for i in range(4)], dim=16))
    trainer.fit(uneven, datamodule=TextDataModule(seq_len=16, global_batch_size=8))
    return trainer.strategy.pipeline.partition.ranges


def _hybrid(world: int, **kwargs: Any) -> dict[str, Any]:
    return fit_gpt(HybridParallelStrategy(microbatches=2, **kwargs), world, CONFIG)


class WallClock(Callback):
    """The test's own clock and the logged tokens/s at the last step, next to the Throughput callback."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.elapsed = time.perf_counter() - self.start
        self.logged = {k: float(trainer.callback_metrics[k]) for k in ("train/tokens_per_sec", "train/tokens")}


def _hybrid_timed(world: int, **kwargs: Any) -> dict[str, Any]:
    """The parity run, with Throughput over every step and the test's own clock."""
    clock = WallClock()
    callbacks = [Throughput(window=STEPS, peak_flops=1e9), clock]
    result = fit_gpt(HybridParallelStrategy(microbatches=2, **kwargs), world, CONFIG, callbacks=callbacks)
    return result | {"elapsed": clock.elapsed, "logged": clock.logged}


DP2_TP2_PP2 = {"data_parallel": 2, "tensor_parallel": 2, "pipeline_parallel": 2}
DP2_PP2 = {"data_parallel": 2, "pipeline_parallel": 2}
CASES_8: dict[str, Any] = {
    "ddp": lambda w: _hybrid_timed(w, **DP2_TP2_PP2, data_parallel_mode="ddp"),
    "fsdp": lambda w: _hybrid(w, **DP2_TP2_PP2, data_parallel_mode="fsdp"),
}
CASES_4: dict[str, Any] = {
    "fsdp_grad_op": lambda w: _hybrid(w, **DP2_PP2, data_parallel_mode="fsdp_grad_op"),
    "hsdp": lambda w: _hybrid(w, data_parallel=4, data_parallel_mode="hsdp", hsdp_replicate=2, hsdp_shard=2),
    # Two stages per rank under data parallelism: each stage's view is wrapped on its own.
    **{
        s: lambda w, s=s: _hybrid(w, **DP2_PP2, data_parallel_mode="fsdp", schedule=s)
        for s in ("interleaved_1f1b", "zbv")
    },
    "gathers-m2": lambda w: _gathers_per_step(w, 2),
    "gathers-m8": lambda w: _gathers_per_step(w, 8),
    "tied-v": _tied_v_error,
    "by-cost": _by_cost_cut,
    # The GPT presets' default: the embedding and head share a weight, here cut across stages and split
    # over tp (the embedding's gradient comes back replicated, the head's sharded).
    "tied-tp2-pp2": lambda w: fit_gpt(
        HybridParallelStrategy(microbatches=2, tensor_parallel=2, pipeline_parallel=2), w, TIED
    ),
}


@pytest.fixture(scope="module")
def eight() -> list[dict[str, Any]]:
    return run_distributed(run_cases, 8, __name__, "CASES_8", timeout=480)


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_distributed(run_cases, 4, __name__, "CASES_4", timeout=420)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_dp2_tp2_pp2_matches_one_process(eight: list[dict[str, Any]], mode: str) -> None:
    assert_parity([r[mode] for r in eight], single_process(CONFIG))


@pytest.mark.slow
def test_global_tokens_per_second_at_dp2_tp2_pp2_is_tokens_over_wall_time(eight: list[dict[str, Any]]) -> None:
    # fit_gpt: global batches of 8 sequences of 16 tokens; counted per replica, not per process.
    tokens = STEPS * 8 * 16
    for rank in eight:
        result = rank["ddp"]
        assert result["logged"]["train/tokens"] == tokens
        assert result["logged"]["train/tokens_per_sec"] == pytest.approx(tokens / result["elapsed"], rel=0.02)


@pytest.mark.slow
def test_dp2_pp2_fsdp_grad_op_matches_one_process(four: list[dict[str, Any]]) -> None:
    assert_parity([r["fsdp_grad_op"] for r in four], single_process(CONFIG))


@pytest.mark.slow
def test_dp4_hsdp_2x2_matches_one_process(four: list[dict[str, Any]]) -> None:
    assert_parity([r["hsdp"] for r in four], single_process(CONFIG))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_dp2_pp2_fsdp_with_two_stages_per_rank_matches_one_process(four: list[dict[str, Any]], schedule: str) -> None:
    assert_parity([r[schedule] for r in four], single_process(CONFIG))


@pytest.mark.slow
def test_fsdp_under_a_pipeline_gathers_parameters_once_per_step_not_per_micro_batch(four: list[dict[str, Any]]) -> None:
    two, eight = [r["gathers-m2"] for r in four], [r["gathers-m8"] for r in four]
    assert min(two) > 0, two  # the profiler saw FSDP's all-gathers
    assert two == eight, (two, eight)


@pytest.mark.slow
def test_a_tied_embedding_and_head_at_tp2_pp2_match_one_process(four: list[dict[str, Any]]) -> None:
    assert_parity([r["tied-tp2-pp2"] for r in four], single_process(TIED))


@pytest.mark.slow
def test_a_weight_tied_across_two_stages_of_one_rank_is_refused_with_data_parallelism(
    four: list[dict[str, Any]],
) -> None:
    for result in four:
        message = result["tied-v"]
        assert (
            "one weight shared by two pipeline stages of one rank" in message and "tie_embeddings=False" in message
        ), message


@pytest.mark.slow
def test_by_cost_cuts_every_replica_the_same_way(four: list[dict[str, Any]]) -> None:
    # Replica 0 measures block 0 slow, replica 1 block 3: each alone would cut elsewhere, and the
    # replicas' stages would hold different blocks. The costs are combined over the whole mesh.
    cuts = [r["by-cost"] for r in four]
    assert all(cut == ((0, 2), (2, 4)) for cut in cuts), cuts


# ---------------------------------------------------------------- bad input, before training


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"data_parallel_mode": "zero3"},
            r"data_parallel_mode='zero3' is not one of 'ddp', 'fsdp', 'fsdp_grad_op', 'hsdp'",
        ),
        (
            {"data_parallel": 4, "data_parallel_mode": "hsdp", "hsdp_replicate": 3, "hsdp_shard": 2},
            r"hsdp needs hsdp_replicate x hsdp_shard = data_parallel, but 3 x 2 does not make data_parallel=4",
        ),
        (
            {"data_parallel_mode": "fsdp", "gradient_compression": "powersgd"},
            r"gradient_compression='powersgd' uses DDP communication hooks, which data_parallel_mode='fsdp' does not have",
        ),
        (
            {"gradient_compression": "bf16", "tensor_parallel": 2},
            r"gradient_compression='bf16' applies to plain data parallelism.*tensor_parallel=2 must be 1",
        ),
        (
            {"gradient_compression": "int4"},
            r"gradient_compression='int4' is not one of 'bf16', 'fp16', 'none', 'powersgd'",
        ),
        ({"hsdp_replicate": 2}, r"hsdp_replicate/hsdp_shard are set but data_parallel_mode='ddp'"),
        (
            {"activation_checkpointing": "some"},
            r"activation_checkpointing='some' is not one of 'full', 'none', 'selective'",
        ),
        ({"activation_checkpointing_every": 0}, r"activation_checkpointing_every=0 must be a positive integer"),
        ({"bucket_cap_mb": 0}, r"bucket_cap_mb=0 must be a positive number of megabytes"),
    ],
    ids=[
        "unknown-mode",
        "hsdp-product",
        "compression-fsdp",
        "compression-tp",
        "unknown-compression",
        "hsdp-sizes-without-hsdp",
        "unknown-ac",
        "ac-every",
        "bucket-cap",
    ],
)
def test_bad_data_parallel_settings_are_refused_when_the_strategy_is_built(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HybridParallelStrategy(**kwargs)


def test_a_ddp_flag_that_is_not_a_bool_is_refused() -> None:
    with pytest.raises(TypeError, match=r"static_graph='yes' must be True or False"):
        HybridParallelStrategy(static_graph="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "layout", "match"),
    [
        (
            {"find_unused_parameters": True},
            (1, 2, 1),
            r"find_unused_parameters=True configure DistributedDataParallel, which this run does not use: dp=1 x pp=2 x tp=1 has no data parallelism",
        ),
        (
            {"gradient_as_bucket_view": False},
            (2, 1, 2),
            r"gradient_as_bucket_view=False configure .*dp=2 x pp=1 x tp=2 with data_parallel_mode='ddp' runs FSDP2",
        ),
        (
            {"static_graph": True, "data_parallel_mode": "fsdp"},
            (2, 1, 1),
            r"static_graph=True configure DistributedDataParallel.*data_parallel_mode='fsdp' runs FSDP2",
        ),
    ],
)
def test_ddp_options_without_ddp_are_refused(kwargs: dict[str, Any], layout: tuple[int, int, int], match: str) -> None:
    from lightning_scale.core.parallel.layout import Layout

    with pytest.raises(ValueError, match=match):
        HybridParallelStrategy(**kwargs).options.check_layout(Layout(*layout))


# ---------------------------------------------------------------- plain DDP: wrapped modules, DDP's own options


class _WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 1)
        self.unused = torch.nn.Linear(4, 1)  # never called: DDP must be told to expect no gradient for it


class _UnusedModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _WithUnused()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net.used(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _wrapped_error(world: int, wrapper: str) -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel

    module = GPTLightningModule(CONFIG)
    if wrapper == "ddp":
        module.model.blocks["0"] = torch.nn.parallel.DistributedDataParallel(module.model.blocks["0"])
    else:
        module.model = FullyShardedDataParallel(module.model, device_id=torch.device("cpu"))
    trainer = quiet_trainer(devices=world, strategy=HybridParallelStrategy(data_parallel_mode="fsdp"), max_steps=1)
    return fit_error(trainer, module, datamodule=TextDataModule(seq_len=16, global_batch_size=4))


def _ddp_options(world: int) -> dict[str, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    data = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=2)
    options = {"find_unused_parameters": True, "bucket_cap_mb": 1, "gradient_as_bucket_view": False}
    trainer = quiet_trainer(devices=world, strategy=HybridParallelStrategy(**options), max_steps=3)
    trainer.fit(_UnusedModule(), data)
    ddp = trainer.strategy.model
    seen = {"find_unused_parameters": ddp.find_unused_parameters, "bucket_bytes_cap": ddp.bucket_bytes_cap}
    seen |= {"gradient_as_bucket_view": ddp.gradient_as_bucket_view, "steps": trainer.global_step}
    try:  # without find_unused_parameters DDP stops at the second step, waiting for the unused gradient
        quiet_trainer(devices=world, strategy=HybridParallelStrategy(), max_steps=3).fit(_UnusedModule(), data)
        seen["error"] = "no error"
    except RuntimeError as err:
        seen["error"] = str(err)
    return seen


CASES_2: dict[str, Any] = {
    "wrapped-ddp": lambda w: _wrapped_error(w, "ddp"),
    "wrapped-fsdp1": lambda w: _wrapped_error(w, "fsdp1"),
    "ddp-options": _ddp_options,
}


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_distributed(run_cases, 2, __name__, "CASES_2", timeout=180)


@pytest.mark.parametrize(
    ("wrapper", "label"), [("ddp", "DistributedDataParallel"), ("fsdp1", r"FullyShardedDataParallel \(FSDP1\)")]
)
def test_a_module_already_wrapped_for_data_parallelism_is_refused(
    two: list[dict[str, Any]], wrapper: str, label: str
) -> None:
    for result in two:
        message = result[f"wrapped-{wrapper}"]
        assert re.search(rf"are already wrapped in {label}\. Pass the bare model", message), message


def test_ddp_options_reach_distributed_data_parallel(two: list[dict[str, Any]]) -> None:
    for result in two:
        seen = result["ddp-options"]
        assert "find_unused_parameters=True" in seen.pop("error")
        assert seen == {
            "find_unused_parameters": True,
            "bucket_bytes_cap": 2**20,
            "gradient_as_bucket_view": False,
            "steps": 3,
        }


def test_plain_ddp_keeps_gradients_as_views_of_its_buckets_unless_told_otherwise() -> None:
    # the package's default, not DDP's: no copy of the gradients into the buckets every step
    assert HybridParallelStrategy().options.ddp_kwargs(hooks=True)["gradient_as_bucket_view"] is True
    assert HybridParallelStrategy().options.ddp_kwargs() == {}  # a default is not a DDP option someone set
    assert (
        HybridParallelStrategy(gradient_as_bucket_view=False).options.ddp_kwargs(hooks=True)["gradient_as_bucket_view"]
        is False
    )


# ---------------------------------------------------------------- activation checkpointing and torch.compile, composed


def _losses_with(rank: int, world: int, variants: list[dict[str, Any]]) -> list[tuple[list[float], list[str]]]:
    results = []
    for kwargs in variants:
        seed_everything(0, verbose=False)
        record = RecordLoss()
        config = GPTConfig(n_layers=2, d_model=32, n_heads=2, block_size=16, tie_embeddings=False)
        module = GPTLightningModule(config)
        strategy = HybridParallelStrategy(data_parallel=1, **kwargs)
        trainer = quiet_trainer(devices=1, strategy=strategy, max_steps=3, callbacks=[record])
        trainer.fit(module, datamodule=TextDataModule(seq_len=16, global_batch_size=2))
        compiled = [name for name, m in module.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
        results.append((record.losses, compiled))
    return results


@pytest.mark.slow
def test_compiled_and_checkpointed_blocks_train_like_plain_ones() -> None:
    (plain, none_compiled), (fancy, compiled) = run_distributed(
        _losses_with, 1, [{}, {"compile": True, "activation_checkpointing": "full"}], timeout=300
    )[0]
    assert none_compiled == [] and compiled == ["model.blocks.0", "model.blocks.1"]
    torch.testing.assert_close(fancy, plain, rtol=1e-4, atol=0)
