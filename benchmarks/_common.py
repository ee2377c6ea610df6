"""What every benchmark here shares: worker processes on a parent-served store, a step timer, the report."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import Callback, Trainer

__all__ = ["RESULTS", "StepTimer", "emit", "join_process_group", "model_arguments", "run_workers", "timed"]

RESULTS = Path(__file__).resolve().parent / "results"


class StepTimer(Callback):
    """Seconds from ``on_train_batch_start`` to ``on_train_batch_end`` of every step, and the first logged loss."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.first_loss: float | None = None
        self._start = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.times.append(time.perf_counter() - self._start)
        loss = trainer.callback_metrics.get("train/loss")
        if self.first_loss is None and loss is not None:
            self.first_loss = float(loss)


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """The GPT shape every benchmark here takes: --layers, --d-model, --heads, --seq."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)


def timed(fn: Callable[[], Any], steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``fn``."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def join_process_group(rank: int, world: int, port: int, **env: str) -> None:
    """In a worker: one thread, the environment Lightning reads, and the gloo group on the parent's store."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **env,
    )  # fmt: skip
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def run_workers(worker: Callable[..., None], world: int, args: argparse.Namespace) -> Any:
    """Start ``worker(rank, world, port, args, queue)`` in ``world`` processes; returns what rank 0 puts on the queue."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, store.port, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    result = queue.get(timeout=3600)
    for proc in procs:
        proc.join(timeout=120)
    return result


def emit(name: str, report: dict[str, Any], out: Path) -> None:
    """Write the report to ``out`` and print it as the final ``BENCH <name> {json}`` line."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"BENCH {name} {json.dumps(report)}", flush=True)
