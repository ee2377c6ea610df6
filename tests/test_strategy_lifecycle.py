"""The strategy's life around a Trainer call: plugins it owns are torn down with it."""

from __future__ import annotations

from pathlib import Path

from helpers.distributed import run_distributed
from helpers.lightning import quiet_trainer
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import AsyncCheckpointIO

import lightning_scale  # noqa: F401
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.strategies import HybridParallelStrategy


def _fit_with_a_whole_file_checkpoint_io(rank: int, world: int, out: str) -> str:
    strategy = HybridParallelStrategy(checkpoint_io=AsyncCheckpointIO(TorchCheckpointIO()))
    trainer = quiet_trainer(
        devices=world,
        strategy=strategy,
        max_steps=1,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=1)],
    )
    config = GPTConfig(n_layers=1, d_model=16, n_heads=2, block_size=8)
    try:
        trainer.fit(GPTLightningModule(config), datamodule=TextDataModule(seq_len=8, global_batch_size=2))
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_checkpoint_io_that_writes_whole_files_from_one_rank_is_refused_before_training(tmp_path: Path) -> None:
    # Whole-state files would need the whole model gathered on one rank: the strategy saves sharded only.
    (message,) = run_distributed(_fit_with_a_whole_file_checkpoint_io, 1, str(tmp_path), timeout=120)
    assert "checkpoint_io=AsyncCheckpointIO writes whole files from one rank" in message, message
    assert "ShardedCheckpointIO" in message and not list(tmp_path.iterdir())
