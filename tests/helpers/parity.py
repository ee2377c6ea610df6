"""Train the reference GPT under a strategy and compare with one process: losses, val loss, parameters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from helpers.lightning import quiet_trainer
from lightning_scale.callbacks import GradNormMonitor
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule

__all__ = ["STEPS", "RecordLoss", "assert_parity", "fit_gpt", "full_parameters", "single_process"]


STEPS = 4
"""Optimizer steps of a parity run: in fp64 with the gradient norm compared at every step, a wrong
gradient anywhere shows from the first step, so a few steps are enough."""


class RecordLoss(Callback):
    """Every rank's logged ``train/loss`` (and ``train/grad_norm`` when logged) after each batch, and
    the ``outputs["loss"]`` callbacks receive."""

    def __init__(self, name: str = "train/loss") -> None:
        self.name = name
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.outputs: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics[self.name]))
        self.outputs.append(float(outputs["loss"]))
        if "train/grad_norm" in trainer.callback_metrics:
            self.grad_norms.append(float(trainer.callback_metrics["train/grad_norm"]))


def full_parameters(module: Any, devices: int) -> dict[str, torch.Tensor]:
    """The whole model's state under its original names, on every rank (a collective when ``devices > 1``)."""
    if devices == 1:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
    # Full tensors of what this rank holds (a collective over shards), merged over all ranks.
    local = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(devices)]
    torch.distributed.all_gather_object(parts, {k: v.cpu() for k, v in local.items()})
    return {k: v for part in parts for k, v in part.items()}


def fit_gpt(
    strategy: Any,
    devices: int,
    config: GPTConfig,
    *,
    steps: int = STEPS,
    accumulate: int = 1,
    precision: str = "64-true",
    global_batch_size: int = 8,
    callbacks: Sequence[Callback] = (),
    deferred_init: bool = False,
) -> dict[str, Any]:
    """Fit with clipping and validation; returns this rank's losses, the val loss and the full parameters."""
    seed_everything(0, verbose=False)
    record = RecordLoss()
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        gradient_clip_val=0.5,
        accumulate_grad_batches=accumulate,
        callbacks=[GradNormMonitor(), record, *callbacks],
        limit_val_batches=4,
        val_check_interval=None,
        check_val_every_n_epoch=None,
    )
    module = GPTLightningModule(config, learning_rate=3e-3, warmup_steps=3, deferred_init=deferred_init)
    datamodule = TextDataModule(seq_len=min(32, config.block_size), global_batch_size=global_batch_size)
    trainer.fit(module, datamodule=datamodule)
    val = trainer.validate(module, datamodule=datamodule, verbose=False)[0]["val/loss"]
    state = full_parameters(module, devices)
    # outputs["loss"] is the training_step's: the rank's own share of the batch, except under a
    # pipeline, where the strategy returns the whole global batch's loss on every rank.
    pipelined = getattr(trainer.strategy, "_pipeline", None) is not None
    outputs = record.outputs if devices == 1 or pipelined else None
    return {"losses": record.losses, "outputs": outputs, "grad_norms": record.grad_norms, "val": val, "state": state}


def assert_parity(results: list[dict[str, Any]], reference: dict[str, Any], rtol: float = 1e-5) -> None:
    for result in results:
        # Every rank logs the true loss (the last pipeline stage's, averaged over replicas).
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=rtol, atol=0)
        if result["outputs"] is not None:
            # What callbacks receive as outputs["loss"]: the step's loss (divided by the accumulation).
            torch.testing.assert_close(result["outputs"], reference["outputs"], rtol=rtol, atol=0)
        # The global gradient norm (before clipping), over every shard, replica and stage.
        assert len(result["grad_norms"]) == len(reference["grad_norms"]) > 0
        torch.testing.assert_close(result["grad_norms"], reference["grad_norms"], rtol=rtol, atol=0)
        assert result["val"] == pytest.approx(reference["val"], rel=rtol)
        assert result["state"].keys() == reference["state"].keys()
        for name, value in reference["state"].items():
            torch.testing.assert_close(result["state"][name], value, rtol=rtol, atol=rtol / 100, msg=name)


_SINGLE: dict[tuple[Any, ...], dict[str, Any]] = {}


def single_process(
    config: GPTConfig,
    *,
    steps: int = STEPS,
    accumulate: int = 1,
    precision: str = "64-true",
    global_batch_size: int = 8,
) -> dict[str, Any]:
    """:func:`fit_gpt` on one process, run once per test session for each setting: every module's
    parity tests with the same model and settings share it. Treat the result as read-only."""
    key = (config, steps, accumulate, precision, global_batch_size)
    if key not in _SINGLE:
        _SINGLE[key] = fit_gpt(
            "auto",
            1,
            config,
            steps=steps,
            accumulate=accumulate,
            precision=precision,
            global_batch_size=global_batch_size,
        )
    return _SINGLE[key]
