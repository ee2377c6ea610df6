"""A run that loses work on purpose, for the goodput test: under ``torchrun --max-restarts 1``, two ranks train
with a checkpoint every ``CKPT_EVERY`` steps and steps slowed to about ``SLEEP_S``; on the first launch, rank 0
SIGKILLs both ranks (no handler runs) at the start of step ``KILL_AT``; the relaunch resumes from the newest
checkpoint and completes. Rank 0 writes the truth the test compares the goodput ledger with, by its own
clock, to ``OUT/truth.jsonl``: when training went on after each checkpoint, the kill, each launch's first step.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/scripts/goodput_kill.py OUT STEPS CKPT_EVERY KILL_AT SLEEP_S
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_scale.callbacks import GoodputMonitor
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.strategies import HybridParallelStrategy

RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Truth(Callback):
    def __init__(self, out: Path, ckpt_every: int, kill_at: int, sleep_s: float) -> None:
        self.out, self.ckpt_every, self.kill_at, self.sleep_s = out, ckpt_every, kill_at, sleep_s
        self.first = True

    def _note(self, **record: Any) -> None:
        with open(self.out / "truth.jsonl", "a") as f:
            f.write(json.dumps({"restart": RESTART, **record}) + "\n")

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        (self.out / "pids").mkdir(exist_ok=True)
        (self.out / "pids" / f"{RESTART}-{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        now, step = time.time(), trainer.global_step
        if trainer.global_rank != 0:
            return
        if self.first:
            self.first = False
            self._note(first_step=now, step=step)
        elif step % self.ckpt_every == 0:
            self._note(after_save=now, step=step)  # the checkpoint of `step` was committed just before
        if RESTART == 0 and step == self.kill_at:
            self._note(kill=time.time(), step=step)
            other = int((self.out / "pids" / f"{RESTART}-1").read_text())
            os.kill(other, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        time.sleep(self.sleep_s)  # slow hardware: lost work of seconds, long against the ledger's 0.1 s resolution


def main(out: Path, steps: int, ckpt_every: int, kill_at: int, sleep_s: float) -> None:
    seed_everything(0, verbose=False)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=HybridParallelStrategy(data_parallel=2, hang_timeout=0),
        default_root_dir=out,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            GoodputMonitor(progress_s=0.1),
            Truth(out, ckpt_every, kill_at, sleep_s),
            ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=ckpt_every, save_top_k=-1, filename="{step}"),
        ],
    )
    config = GPTConfig(n_layers=2, d_model=32, n_heads=2, block_size=16)
    trainer.fit(GPTLightningModule(config, warmup_steps=2), datamodule=TextDataModule(seq_len=16, global_batch_size=8))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out, steps, every, kill_at, sleep_s = sys.argv[1:6]
    main(Path(out), int(steps), int(every), int(kill_at), float(sleep_s))
