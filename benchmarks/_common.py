"""What every benchmark here shares: worker processes on a parent-served store, a step timer, the report."""

from __future__ import annotations

import argparse
import json
import os
import queue as queue_module
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import Callback, Trainer

__all__ = [
    "RESULTS",
    "BatchEndGaps",
    "HookTime",
    "StepTimer",
    "emit",
    "fit_arguments",
    "fit_report",
    "join_process_group",
    "model_arguments",
    "run_workers",
    "timed",
]

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


class BatchEndGaps(Callback):
    """Seconds between consecutive ``on_train_batch_end`` calls (put it last in the callback list: a step is
    then every callback's hooks, the logging steps' collectives included)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ends.append(time.perf_counter())

    def steps(self, warmup: int) -> list[float]:
        """The gaps, the first ``warmup`` dropped."""
        return [b - a for a, b in zip(self.ends, self.ends[1:])][warmup:]


STEP_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
)
START_HOOKS = ("setup", "on_fit_start", "on_train_start")


class HookTime:
    """Seconds spent inside instrumented callback methods: the per-step hooks (``seconds``) and, apart,
    the once-per-fit start (``start_seconds``: FLOP counting, the CPU peak's measurement, host names)."""

    def __init__(self, per_step: bool = True) -> None:
        self.per_step = per_step  # False: the start hooks only (a wrapper adds its own cost to every step)
        self.seconds = 0.0
        self.start_seconds = 0.0
        self.by_hook: dict[str, float] = {}  # "Callback.hook" -> per-step seconds, summed over the fit

    def instrument(self, callback: Callback) -> Callback:
        for name in (*(STEP_HOOKS if self.per_step else ()), *START_HOOKS):
            if getattr(type(callback), name) is getattr(Callback, name):
                continue  # Callback's own no-op: nothing to time, and a wrapper would add its own cost to the step
            self._wrap(callback, name, per_step=name in STEP_HOOKS)
        return callback

    def instrument_methods(self, obj: Any, names: Sequence[str]) -> Any:
        """Time ``obj``'s methods ``names`` into ``seconds`` as per-step hooks, wrapped on the instance: what a
        strategy calls at every step without a callback (its hang watchdog's beats)."""
        for name in names:
            self._wrap(obj, name, per_step=True)
        return obj

    def _wrap(self, obj: Any, name: str, per_step: bool) -> None:
        method = getattr(obj, name)
        key = f"{type(obj).__name__}.{name}"

        def timed(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.perf_counter() - begin
                if per_step:
                    self.seconds += spent
                    self.by_hook[key] = self.by_hook.get(key, 0.0) + spent
                else:
                    self.start_seconds += spent

        setattr(obj, name, timed)


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """The GPT shape every benchmark here takes: --layers, --d-model, --heads, --seq."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)


def fit_arguments(
    doc: str,
    name: str,
    *,
    rounds: int,
    steps: int = 200,
    steps_help: str = "optimizer steps per fit",
    extra: Callable[[argparse.ArgumentParser], Any] | None = None,
) -> argparse.Namespace:
    """The command line of a benchmark that fits a GPT preset on two processes, variant after variant, in
    rounds: --preset, --batch, --seq, --steps, --warmup, --rounds, --threads, --out (default
    ``results/<name>.json``), and what ``extra`` adds."""
    from lightning_scale.models import PRESETS

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (1: the steadiest timings)")
    parser.add_argument("--out", type=Path, default=RESULTS / f"{name}.json")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup} + 1")
    return args


def fit_report(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """The first fields of such a benchmark's report: what was fitted, how often, on how many processes."""
    return {
        "model": args.preset,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": args.threads,
        "processes": world,
        "strategy": f"HybridParallelStrategy(data_parallel={world})",
    }


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
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        **env,
    )
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def mean_se(values: list[float]) -> tuple[float, float | None]:
    """The mean of ``values`` and its standard error (``None`` from one value)."""
    mean = statistics.mean(values)
    return mean, statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None


def run_workers(worker: Callable[..., None], world: int, args: argparse.Namespace) -> Any:
    """Start ``worker(rank, world, port, args, queue)`` in ``world`` processes; returns what rank 0 puts on the queue."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, store.port, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 3600
    while True:  # a worker that died (an exception, a crash) fails the benchmark now, not at the deadline
        try:
            result = queue.get(timeout=5)
            break
        except queue_module.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for proc in procs:
                    proc.kill()
                raise RuntimeError(
                    f"workers failed before reporting (rank, exit code): {dead or 'timed out'}"
                ) from None
    for proc in procs:
        proc.join(timeout=120)
    return result


def emit(name: str, report: dict[str, Any], out: Path) -> None:
    """Write the report to ``out`` and print it as the final ``BENCH <name> {json}`` line."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"BENCH {name} {json.dumps(report)}", flush=True)
