"""A run for an elastic torchrun launch (``--nnodes=MIN:MAX``): fp64 tiny GPT, a global batch of 8 in micro-batches
of 2 per rank (accumulation 1 at world 4, 2 at world 2), a checkpoint every 2 steps, auto-resume on every
(re)start. Rank 0 appends one JSON line per start and per optimizer step (world size, accumulation, wall time)
to ``OUT/events.jsonl`` and saves the final parameters to ``OUT/final.pt``. Every rank that exits normally writes
the process-group threads still running after every other exit handler to ``OUT/exit-threads-<rank>.json``: none
(the strategy ends the groups at exit, which a script like this one never does itself). Used by ``tests/test_elastic.py``.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=job --max-restarts=3 tests/scripts/elastic_world.py OUT STEPS [PACE_S]
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_scale.callbacks import GoodputMonitor
from lightning_scale.core.parallel.process_groups import communication_threads
from lightning_scale.core.resilience import launched_sizes
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.plugins import ShardedCheckpointIO
from lightning_scale.strategies import HybridParallelStrategy


class Events(Callback):
    """Rank 0's record of each start and optimizer step; every rank sleeps ``pace_s`` after a step (so a test
    can act mid-run)."""

    def __init__(self, out: Path, pace_s: float) -> None:
        self.out, self.pace_s = out, pace_s
        self._last_step = -1

    def _write(self, trainer: Trainer, **record: Any) -> None:
        if trainer.global_rank == 0:
            record |= {
                "world": trainer.world_size,
                "accumulation": trainer.accumulate_grad_batches,
                "time": time.time(),
            }
            record["restart"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            with open(self.out / "events.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self._last_step = trainer.global_step
        resumed = trainer.strategy.checkpoint_io.resumed_from
        self._write(trainer, event="start", step=trainer.global_step, resumed_from=str(resumed) if resumed else None)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self._last_step:  # an optimizer step, not an accumulation micro-step
            self._last_step = trainer.global_step
            self._write(trainer, event="step", step=trainer.global_step)
            time.sleep(self.pace_s)


def _record_exit_threads(out: Path) -> None:
    (out / f"exit-threads-{os.environ['RANK']}.json").write_text(json.dumps(communication_threads()))


def main(out: Path, steps: int, pace_s: float) -> None:
    atexit.register(_record_exit_threads, out)  # registered first: it runs after every later handler
    seed_everything(0, verbose=False)
    sizes = launched_sizes() or {"num_nodes": 1, "devices": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}
    trainer = Trainer(
        accelerator="cpu",
        **sizes,  # this attempt's nodes and processes per node: they change when the world does
        strategy=HybridParallelStrategy(
            data_parallel="auto",
            checkpoint_io=ShardedCheckpointIO(auto_resume=True),
            hang_timeout={"floor_s": 30.0, "warmup_s": 120.0},
        ),
        precision="64-true",
        max_steps=steps,
        gradient_clip_val=0.5,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            Events(out, pace_s),
            GoodputMonitor(out),  # the goodput ledger across the attempts (rank 0 of each writes it)
            ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}"),
        ],
    )
    module = GPTLightningModule(
        GPTConfig(n_layers=2, d_model=32, n_heads=2, block_size=16), learning_rate=3e-3, warmup_steps=2
    )
    data = TextDataModule(seq_len=16, global_batch_size=8, micro_batch_size=2)
    trainer.fit(module, datamodule=data)
    trainer.strategy.barrier()
    if trainer.global_rank == 0:  # plain DDP: every rank holds the whole model
        torch.save({k: v.detach().clone() for k, v in module.model.state_dict().items()}, out / "final.pt")
        (out / "events.jsonl").open("a").write(
            json.dumps({"event": "end", "step": trainer.global_step, "world": trainer.world_size, "time": time.time()})
            + "\n"
        )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
