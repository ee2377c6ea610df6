"""3D parallelism: dp x tp x pp together, FSDP2 modes on the data-parallel axis; parity with one process."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.lightning import fit_error, quiet_trainer
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


# ---------------------------------------------------------------- gradient compression (DDP communication hooks)


def _final_val_losses(rank: int, world: int, kinds: tuple[str, ...], steps: int) -> dict[str, float]:
    from lightning.pytorch import seed_everything

    from lightning_scale.data import TextDataModule
    from lightning_scale.models import GPTLightningModule

    results = {}
    for kind in kinds:
        seed_everything(0, verbose=False)
        strategy = HybridParallelStrategy(data_parallel=world, gradient_compression=kind, powersgd_rank=2)
        trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=steps, limit_val_batches=8)
        module = GPTLightningModule(GPTConfig.from_preset("tiny"), learning_rate=3e-3, warmup_steps=10)
        datamodule = TextDataModule(seq_len=64, global_batch_size=8)
        trainer.fit(module, datamodule=datamodule)
        results[kind] = trainer.validate(module, datamodule=datamodule, verbose=False)[0]["val/loss"]
    return results


@pytest.mark.slow
def test_bf16_and_powersgd_compression_train_within_3_percent_of_uncompressed() -> None:
    losses = run_distributed(_final_val_losses, 2, ("none", "fp16", "bf16", "powersgd"), 200, timeout=600)[0]
    print("final val loss after 200 steps at dp=2:", losses)
    assert losses["none"] < 3.6  # it learned: the byte-level loss starts at about 5.5
    for kind in ("fp16", "bf16", "powersgd"):
        assert abs(losses[kind] - losses["none"]) <= 0.03 * losses["none"], (kind, losses)
    # Compression changed the arithmetic (the hooks ran), and only a little.
    assert len(set(losses.values())) == len(losses), losses


# ---------------------------------------------------------------- bad input, before training


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"data_parallel_mode": "zero3"}, r"data_parallel_mode='zero3' is not one of 'ddp', 'fsdp', 'fsdp_grad_op', 'hsdp'"),
        (
            {"data_parallel": 4, "data_parallel_mode": "hsdp", "hsdp_replicate": 3, "hsdp_shard": 2},
            r"hsdp needs hsdp_replicate x hsdp_shard = data_parallel, but 3 x 2 does not make data_parallel=4",
        ),
        ({"data_parallel_mode": "fsdp", "gradient_compression": "powersgd"}, r"gradient_compression='powersgd' uses DDP communication hooks, which data_parallel_mode='fsdp' does not have"),
        ({"gradient_compression": "bf16", "tensor_parallel": 2}, r"gradient_compression='bf16' applies to plain data parallelism.*tensor_parallel=2 must be 1"),
        ({"gradient_compression": "int4"}, r"gradient_compression='int4' is not one of 'bf16', 'fp16', 'none', 'powersgd'"),
        ({"hsdp_replicate": 2}, r"hsdp_replicate/hsdp_shard are set but data_parallel_mode='ddp'"),
        ({"activation_checkpointing": "some"}, r"activation_checkpointing='some' is not one of 'full', 'none', 'selective'"),
        ({"activation_checkpointing_every": 0}, r"activation_checkpointing_every=0 must be a positive integer"),
    ],
    ids=["unknown-mode", "hsdp-product", "compression-fsdp", "compression-tp", "unknown-compression", "hsdp-sizes-without-hsdp", "unknown-ac", "ac-every"],
)  # fmt: skip
def test_bad_data_parallel_settings_are_refused_when_the_strategy_is_built(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HybridParallelStrategy(**kwargs)


def _wrapped_error(rank: int, world: int, wrapper: str) -> str:
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    from lightning_scale.data import TextDataModule
    from lightning_scale.models import GPTLightningModule

    module = GPTLightningModule(CONFIG)
    if wrapper == "ddp":
        module.model.blocks["0"] = torch.nn.parallel.DistributedDataParallel(module.model.blocks["0"])
    else:
        module.model = FullyShardedDataParallel(module.model, device_id=torch.device("cpu"))
    trainer = quiet_trainer(devices=world, strategy=HybridParallelStrategy(data_parallel_mode="fsdp"), max_steps=1)
    return fit_error(trainer, module, datamodule=TextDataModule(seq_len=16, global_batch_size=4))


@pytest.mark.parametrize(("wrapper", "label"), [("ddp", "DistributedDataParallel"), ("fsdp1", r"FullyShardedDataParallel \(FSDP1\)")])
def test_a_module_already_wrapped_for_data_parallelism_is_refused(wrapper: str, label: str) -> None:
    for message in run_distributed(_wrapped_error, 2, wrapper, timeout=120):
        assert re.search(rf"are already wrapped in {label}\. Pass the bare model", message), message


# ---------------------------------------------------------------- FSDP under a pipeline: gather once per step


def _all_gathers_in_a_step(rank: int, world: int, microbatches: int) -> int:
    from lightning.pytorch import Callback, seed_everything
    from torch.profiler import ProfilerActivity, profile

    from lightning_scale.data import TextDataModule
    from lightning_scale.models import GPTLightningModule

    counts: list[int] = []

    class _Count(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.prof.__exit__(None, None, None)
            counts.append(sum(e.count for e in self.prof.key_averages() if "all_gather" in e.key))

    seed_everything(0, verbose=False)
    strategy = HybridParallelStrategy(
        data_parallel=2, pipeline_parallel=2, data_parallel_mode="fsdp", microbatches=microbatches
    )
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=2, callbacks=[_Count()])
    trainer.fit(GPTLightningModule(CONFIG), datamodule=TextDataModule(seq_len=32, global_batch_size=16))
    return counts[-1]


@pytest.mark.slow
def test_fsdp_under_a_pipeline_gathers_parameters_once_per_step_not_per_micro_batch() -> None:
    two = run_distributed(_all_gathers_in_a_step, 4, 2, timeout=300)
    eight = run_distributed(_all_gathers_in_a_step, 4, 8, timeout=300)
    assert min(two) > 0, two  # the profiler saw FSDP's all-gathers
    assert two == eight, (two, eight)


# ---------------------------------------------------------------- activation checkpointing and torch.compile, composed


def _losses_with(rank: int, world: int, kwargs: dict[str, Any]) -> tuple[list[float], list[str]]:
    from helpers.parity import RecordLoss
    from lightning.pytorch import seed_everything

    from lightning_scale.data import TextDataModule
    from lightning_scale.models import GPTLightningModule

    seed_everything(0, verbose=False)
    record = RecordLoss()
    config = GPTConfig(n_layers=2, d_model=32, n_heads=2, block_size=16, tie_embeddings=False)
    module = GPTLightningModule(config)
    trainer = quiet_trainer(devices=1, strategy=HybridParallelStrategy(data_parallel=1, **kwargs), max_steps=3, callbacks=[record])
    trainer.fit(module, datamodule=TextDataModule(seq_len=16, global_batch_size=2))
    compiled = [name for name, m in module.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
    return record.losses, compiled


@pytest.mark.slow
def test_compiled_and_checkpointed_blocks_train_like_plain_ones() -> None:
    plain, none_compiled = run_distributed(_losses_with, 1, {}, timeout=120)[0]
    fancy, compiled = run_distributed(
        _losses_with, 1, {"compile": True, "activation_checkpointing": "full"}, timeout=300
    )[0]
    assert none_compiled == [] and compiled == ["model.blocks.0", "model.blocks.1"]
    torch.testing.assert_close(fancy, plain, rtol=1e-4, atol=0)


# ---------------------------------------------------------------- several stages per rank under data parallelism


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_dp2_pp2_fsdp_with_two_stages_per_rank_matches_one_process(single: dict[str, Any], schedule: str) -> None:
    kwargs = {"data_parallel": 2, "pipeline_parallel": 2, "data_parallel_mode": "fsdp", "microbatches": 2, "schedule": schedule}
    assert_parity(run_distributed(_hybrid, 4, kwargs, timeout=300), single)


def _tied_v_error(rank: int, world: int) -> str:

    from lightning_scale.data import TextDataModule
    from lightning_scale.models import GPTLightningModule

    tied = GPTConfig(n_layers=4, d_model=64, n_heads=4, block_size=32, tie_embeddings=True)
    strategy = HybridParallelStrategy(data_parallel=2, pipeline_parallel=2, schedule="zbv", microbatches=2)
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=1)
    return fit_error(trainer, GPTLightningModule(tied), datamodule=TextDataModule(seq_len=16, global_batch_size=4))


def test_a_weight_tied_across_two_stages_of_one_rank_is_refused_with_data_parallelism() -> None:
    for message in run_distributed(_tied_v_error, 4, timeout=180):
        assert "one weight shared by two pipeline stages of one rank" in message and "tie_embeddings=False" in message, message
