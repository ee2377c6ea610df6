"""A small training run for ``torchrun --max-restarts``: it checkpoints every two steps, resumes by
itself when relaunched, journals every start, and saves its final state. Used by the kill test and the
hang test (``--hang-at=STEP``: on the first launch, rank 1 stalls at that step's start; the hang watchdog,
limited to 3 s a step, ends both ranks with HANG_EXIT_CODE and the relaunch resumes).

    torchrun --standalone --nproc-per-node 2 --max-restarts 12 tests/scripts/elastic_run.py OUT LAYOUT STEPS [--no-checkpoints] [--hang-at=STEP]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_scale  # noqa: F401
from lightning_scale.core.checkpoint.format import verify
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.plugins import ShardedCheckpointIO
from lightning_scale.strategies import HybridParallelStrategy

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2": {"data_parallel": 2},
    "pp2": {"data_parallel": 1, "pipeline_parallel": 2, "microbatches": 2},
}


class Journal(Callback):
    """One line per process start: restart count, rank, pid, the step it starts at, what it resumed from."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        io = trainer.strategy.checkpoint_io
        resumed = io.resumed_from
        record = {
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "rank": trainer.global_rank,
            "pid": os.getpid(),
            "master_port": os.environ.get("MASTER_PORT"),
            "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
            "start_step": trainer.global_step,
            "resumed_from": str(resumed) if resumed else None,
            "resumed_step": verify(resumed)["global_step"] if resumed else None,
        }
        with open(self.out / "journal.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        (self.out / "pids").mkdir(exist_ok=True)
        (self.out / "pids" / f"{record['restart']}-{record['rank']}").write_text(str(os.getpid()))


class StallOnce(Callback):
    """Rank 1 of the first launch sleeps at the start of step ``step`` (inside the watchdog's clock, which
    starts first), while rank 0 goes on into the step's gradient all-reduce."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_launch and trainer.global_rank == 1 and trainer.global_step == self.step:
            time.sleep(600)


def main(out: Path, layout: str, steps: int, checkpoints: bool = True, hang_at: int | None = None) -> None:
    seed_everything(0, verbose=False)
    hang = {"hang_timeout": {"floor_s": 3.0, "warmup_s": 120.0}} if hang_at is not None else {}
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=HybridParallelStrategy(**LAYOUTS[layout], checkpoint_io=ShardedCheckpointIO(keep_last=3), **hang),
        default_root_dir=out,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Journal(out)]
        + ([StallOnce(hang_at)] if hang_at is not None else [])
        + (
            [ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")]
            if checkpoints
            else []
        ),
    )
    config = GPTConfig(n_layers=2, d_model=32, n_heads=2, block_size=16, tie_embeddings=True)
    module = GPTLightningModule(config, learning_rate=3e-3, warmup_steps=2)
    trainer.fit(module, datamodule=TextDataModule(seq_len=16, global_batch_size=8))  # no ckpt_path: auto-resume
    trainer.save_checkpoint(out / "final")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    flags = sys.argv[4:]
    hang_at = next((int(f.split("=", 1)[1]) for f in flags if f.startswith("--hang-at=")), None)
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), checkpoints="--no-checkpoints" not in flags, hang_at=hang_at)
