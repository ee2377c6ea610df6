"""A run resumed from a mid-epoch checkpoint trains on exactly the batches an uninterrupted run does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_scale.data import TextDataModule, prepare
from lightning_scale.models import GPTConfig, GPTLightningModule

TINY = GPTConfig(n_layers=1, d_model=32, n_heads=2, block_size=16)


class _RecordBatches(Callback):
    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batches.append(batch[0][:, :4].flatten().tolist())


@pytest.fixture
def small_data(tmp_path: Path) -> Path:
    text = "".join(f"{i:05d} the quick brown fox\n" for i in range(36))  # 864 bytes: ~11 batches of 4 x 16
    (tmp_path / "corpus.txt").write_text(text)
    return prepare(tmp_path / "corpus.txt", tmp_path / "prepared", val_fraction=0.25, chunk_tokens=128)


def _fit(data: Path, root: Path, max_steps: int, workers: int, ckpt_path: str | None = None, every: int | None = None):
    torch.manual_seed(0)
    record = _RecordBatches()
    callbacks: list[Callback] = [record]
    # The resumed run gets the same checkpoint callback (Lightning restores its state too).
    callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=every or 13, save_top_k=-1))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
    )
    module = GPTLightningModule(TINY, learning_rate=1e-2, warmup_steps=2)
    dm = TextDataModule(data, seq_len=16, global_batch_size=4, seed=5, num_workers=workers)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return record.batches, module, trainer


@pytest.mark.filterwarnings("error:.*not resumable.*")
@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers-prefetching"])
def test_mid_epoch_resume_continues_on_the_next_batch(small_data: Path, tmp_path: Path, workers: int) -> None:
    full, full_module, trainer = _fit(small_data, tmp_path / "a", max_steps=24, workers=workers)
    batches_per_epoch = trainer.num_training_batches
    assert 5 <= batches_per_epoch < 13, "the run must cross epoch boundaries and stop mid-epoch"

    # Same schedule length as the full run (the cosine depends on max_steps); resume from step 13.
    first, _, _ = _fit(small_data, tmp_path / "b", max_steps=24, workers=workers, every=13)
    ckpt = next((tmp_path / "b" / "ckpt").glob("*step=13.ckpt"))
    rest, resumed_module, _ = _fit(small_data, tmp_path / "b", max_steps=24, workers=workers, ckpt_path=str(ckpt))

    assert first == full
    assert rest == full[13:], "resumed run did not continue on the next batch"
    # Same data and the same optimizer/scheduler state: the same final weights.
    for (name, a), b in zip(full_module.named_parameters(), resumed_module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)

    reloaded = GPTLightningModule.load_from_checkpoint(ckpt)
    assert reloaded.config == TINY
