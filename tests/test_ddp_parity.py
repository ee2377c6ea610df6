"""Data parallelism through the harness: dp=2 trains exactly like one process on the same global batch.

In float64, as the other parity tests: the two ranks' all-reduced gradients differ from one process's in
the last bits (another summation order), and 8 AdamW steps, which divide by the square root of the
second moment, grow that past fp32's 1e-5 on some machines. In float64 the same rounding stays many
orders of magnitude below 1e-9, which is still far below what a wrong batch or reduction would change."""

from __future__ import annotations

from typing import Any

import torch
from helpers.distributed import run_distributed
from helpers.lightning import quiet_trainer
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule

STEPS = 8
RTOL = 1e-9
CONFIG = GPTConfig(n_layers=2, d_model=64, n_heads=4, block_size=32)


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def _train(rank: int, world_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    seed_everything(0, verbose=False)
    losses = _Losses()
    trainer = quiet_trainer(
        devices=world_size,
        strategy="ddp" if world_size > 1 else "auto",
        precision="64-true",
        max_steps=STEPS,
        gradient_clip_val=0.5,
        callbacks=[losses],
    )
    module = GPTLightningModule(CONFIG, learning_rate=3e-3, warmup_steps=2)
    trainer.fit(module, datamodule=TextDataModule(seq_len=32, global_batch_size=8))
    return losses.losses, {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def test_ddp_two_ranks_match_one_process() -> None:
    single_losses, single_params = _train(0, 1)
    results = run_distributed(_train, 2, timeout=120)
    for rank, (losses, params) in enumerate(results):
        assert len(losses) == STEPS
        torch.testing.assert_close(losses, single_losses, rtol=RTOL, atol=0, msg=f"rank {rank} loss curve")
        for name, value in single_params.items():
            assert value.dtype == torch.float64, name
            torch.testing.assert_close(params[name], value, rtol=RTOL, atol=RTOL / 100, msg=f"rank {rank} {name}")
    assert single_losses[-1] < single_losses[0]
