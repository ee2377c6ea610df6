"""One module through several Trainers, as Lightning users do (fit with one, validate/test/predict with
others), at pp=2 and at dp2 x tp2; checkpoints moving to another layout; a module already cut for
one layout refused by a Trainer at another."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.lightning import quiet_trainer
from lightning.pytorch import seed_everything
from torch.utils.data import DataLoader, TensorDataset

import lightning_scale  # noqa: F401
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.strategies import HybridParallelStrategy

CONFIG = GPTConfig(n_layers=4, d_model=32, n_heads=2, block_size=16, tie_embeddings=True)
TOKENS = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))


def _strategy(kwargs: dict[str, Any] | None) -> Any:
    return "auto" if kwargs is None else HybridParallelStrategy(microbatches=2, **kwargs)


def _trainer(devices: int, kwargs: dict[str, Any] | None, **overrides: Any) -> Any:
    return quiet_trainer(devices=devices, strategy=_strategy(kwargs), precision="64-true", **overrides)


def _sequence(devices: int, kwargs: dict[str, Any] | None, ckpt: str | None = None) -> dict[str, Any]:
    """fit, then validate, test and predict, each with a new Trainer (and a new strategy)."""
    seed_everything(0, verbose=False)
    module = GPTLightningModule(CONFIG, learning_rate=3e-3, warmup_steps=2)
    data = TextDataModule(seq_len=16, global_batch_size=8)
    fit = _trainer(devices, kwargs, max_steps=3)
    fit.fit(module, datamodule=data)
    if ckpt is not None:
        fit.save_checkpoint(ckpt)
    return {
        "val": _trainer(devices, kwargs, limit_val_batches=2).validate(module, datamodule=data, verbose=False)[0][
            "val/loss"
        ],
        "test": _trainer(devices, kwargs, limit_test_batches=2).test(module, datamodule=data, verbose=False)[0][
            "test/loss"
        ],
        "predict": torch.cat(
            _trainer(devices, kwargs).predict(module, DataLoader(TensorDataset(TOKENS), batch_size=4))
        ),
        "module": module,
    }


def _validate_checkpoint(devices: int, kwargs: dict[str, Any], ckpt: str) -> float:
    """A fresh module validated from a checkpoint at another layout."""
    trainer = _trainer(devices, kwargs, limit_val_batches=2)
    data = TextDataModule(seq_len=16, global_batch_size=8)
    return trainer.validate(GPTLightningModule(CONFIG), datamodule=data, ckpt_path=ckpt, verbose=False)[0]["val/loss"]


def _run(rank: int, world: int, kwargs: dict[str, Any], other: dict[str, Any], ckpt: str) -> dict[str, Any]:
    result = _sequence(world, kwargs, ckpt)
    module = result.pop("module")
    try:  # the module is cut and wrapped for `kwargs`' layout: a Trainer at another refuses it
        _trainer(world, other, limit_val_batches=1).validate(
            module, datamodule=TextDataModule(seq_len=16, global_batch_size=8)
        )
        result["refused"] = "no error"
    except ValueError as err:
        result["refused"] = str(err)
    result["val_elsewhere"] = _validate_checkpoint(world, other, ckpt)
    if kwargs.get("data_parallel", 1) > 1:
        return result  # FSDP2's replicate/fully_shard refuse deepcopy themselves
    # A cut module stays copyable (StochasticWeightAveraging, torch.save); the copy cannot be set up.
    copied = copy.deepcopy(module)
    try:
        _trainer(world, kwargs, limit_val_batches=1).validate(
            copied, datamodule=TextDataModule(seq_len=16, global_batch_size=8)
        )
        result["copy"] = "no error"
    except ValueError as err:
        result["copy"] = str(err)
    return result


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    result = _sequence(1, None)
    result.pop("module")
    return result


def _check(results: list[dict[str, Any]], single: dict[str, Any], dp: int, layout: str) -> None:
    for rank, result in enumerate(results):
        assert result["val"] == pytest.approx(single["val"], rel=1e-9)
        assert result["test"] == pytest.approx(single["test"], rel=1e-9)
        assert result["val_elsewhere"] == pytest.approx(single["val"], rel=1e-9)
        # Lightning splits prediction data over the data-parallel ranks (every dp-th sample).
        dp_rank = rank // (len(results) // dp)
        expected = single["predict"][dp_rank::dp] if dp > 1 else single["predict"]
        torch.testing.assert_close(result["predict"], expected, rtol=1e-9, atol=1e-12)
        assert f"was already cut and wrapped for {layout} by an earlier Trainer" in result["refused"], result["refused"]
        if dp == 1:
            assert f"is a copy of a module cut and wrapped for {layout}" in result["copy"], result["copy"]


@pytest.mark.slow
def test_fit_then_validate_test_predict_with_new_trainers_at_pp2(single: dict[str, Any], tmp_path: Path) -> None:
    pp2, tp2 = {"data_parallel": 1, "pipeline_parallel": 2}, {"data_parallel": 1, "tensor_parallel": 2}
    results = run_distributed(_run, 2, pp2, tp2, str(tmp_path / "pp2.ckpt"), timeout=300)
    _check(results, single, dp=1, layout="dp=1 x pp=2 x tp=1")


@pytest.mark.slow
def test_fit_then_validate_test_predict_with_new_trainers_at_dp2_tp2(single: dict[str, Any], tmp_path: Path) -> None:
    dp2_tp2, dp2_pp2 = {"data_parallel": 2, "tensor_parallel": 2}, {"data_parallel": 2, "pipeline_parallel": 2}
    results = run_distributed(_run, 4, dp2_tp2, dp2_pp2, str(tmp_path / "dp2tp2.ckpt"), timeout=420)
    _check(results, single, dp=2, layout="dp=2 x pp=1 x tp=2")


def test_only_settings_that_decide_the_cut_must_match_for_a_module_to_be_set_up_again() -> None:
    from lightning_scale.core.parallel.layout import Layout
    from lightning_scale.strategies.hybrid.options import ParallelOptions

    layout = Layout(dp=2, pp=2, tp=1)
    first = ParallelOptions(data_parallel=2, pipeline_parallel=2, microbatches=4, loss_name="{stage}_loss")
    # Sizes compare as resolved layouts; micro-batches and loss names may change between Trainers, and
    # so may options that do nothing at this layout (loss parallelism without tensor parallelism).
    same = ParallelOptions(
        data_parallel="auto", pipeline_parallel=2, microbatches=8, loss_parallel=False, virtual_stages=3
    )
    assert first.structural_differences(same, layout) == []
    other = ParallelOptions(data_parallel=2, pipeline_parallel=2, schedule="gpipe", activation_checkpointing="full")
    expected = ["schedule='1f1b' vs 'gpipe'", "activation_checkpointing='none' vs 'full'"]
    assert first.structural_differences(other, layout) == expected
