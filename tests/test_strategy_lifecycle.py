"""The strategy's life around a Trainer call: plugins it owns are torn down with it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from helpers.distributed import run_distributed
from helpers.lightning import quiet_trainer
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import AsyncCheckpointIO

import lightning_scale  # noqa: F401
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.strategies import HybridParallelStrategy


class _DiskFull(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        time.sleep(0.5)  # still writing when the training loop moves on
        raise OSError(f"No space left on device: {path}")


def _fit_with_failing_async_saves(rank: int, world: int, out: str) -> str:
    strategy = HybridParallelStrategy(checkpoint_io=AsyncCheckpointIO(_DiskFull()))
    trainer = quiet_trainer(
        devices=world,
        strategy=strategy,
        max_steps=1,  # one save: AsyncCheckpointIO reports an error at the next save, or at teardown
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=1)],
    )
    config = GPTConfig(n_layers=1, d_model=16, n_heads=2, block_size=8)
    try:
        trainer.fit(GPTLightningModule(config), datamodule=TextDataModule(seq_len=8, global_batch_size=2))
    except OSError as err:
        return str(err)
    return "no error"


def test_teardown_joins_an_async_checkpoint_io_and_raises_what_its_saves_raised(tmp_path: Path) -> None:
    # The save runs in AsyncCheckpointIO's thread; only its teardown (joined by the strategy's) reports it.
    (message,) = run_distributed(_fit_with_failing_async_saves, 1, str(tmp_path), timeout=120)
    assert "No space left on device" in message and "step=1.ckpt" in message, message
