"""What the hang watchdog and the goodput accounting cost a training step: ``HybridParallelStrategy``'s watchdog
(the default, ``hang_timeout="auto"``) with a ``GoodputMonitor`` on, against both off, alternating within the same
run, on two processes.

    python benchmarks/resilience.py                      # tiny GPT, 400 steps a fit, blocks of 10, 3 rounds
    python benchmarks/resilience.py --rounds 40          # SE about 0.25% (11 min)
    python benchmarks/resilience.py --rounds 80 --processes 16   # the recorded runs: SE about 0.19% (22 min)
    python benchmarks/resilience.py --switch none        # the control: on and off blocks alike
    python benchmarks/resilience.py --steps 60 --rounds 1

Two processes (gloo), ``HybridParallelStrategy(data_parallel=2)``, the tiny GPT on the bundled corpus,
gradient clipping at 1.0, no other callback. Within each fit both are switched on and off every ``--block`` steps,
both ranks alike; the order alternates between rounds. On: the strategy's own watchdog, as users get it by default
(``hang_timeout="auto"``; no callback: its thread runs and the strategy's per-step methods beat its heart through
``strategy.resilience``, which ``Resilience.switch_watchdog`` starts and stops within the fit), and the goodput
monitor records: its ledger's events, its progress thread writing every second (it reads the step itself), its
``goodput/...`` metrics at the logging steps. Off: the watchdog stopped (the strategy's methods find none to beat,
as under ``hang_timeout=0``) and the monitor out of the Trainer's callbacks, as when it is not used. The
strategy's preemption handling (``ShardedCheckpointIO``'s default: an all-reduce of its flag a step) runs in both,
as it does in every fit. A step's time is the gap between two ``on_train_batch_end``
calls on rank 0; the first ``--warmup`` steps of a fit and the first step of every block (which pays the
thread's start or stop, once per fit in real use) are dropped. ``overhead_fraction`` is the median over
pairs of adjacent blocks of ``on / off - 1`` (target <= 0.005; the bound is no overhead): alternating
every few steps keeps the comparison inside one run, where a shared VM's drift between fits (several
per cent) would swamp it. ``overhead_mean`` and ``overhead_se`` are the mean over disjoint pairs of blocks and its
standard error (the pairs' standard deviation over the square root of their number: the precision of the
comparison; about 1% for the default 3 rounds on a 2-core machine, 0.44% at 12 and 0.25% at 40),
``overhead_of_means`` compares all the on steps with all the off ones, and
``hook_fraction`` is the time timed directly in the "on" steps over the off step: the monitor's hooks, and the
watchdog's beats (its ``step_started`` and ``entered``, wrapped on each watchdog the strategy runs: four calls a
step, at the batch's start, the backward, the optimizer step and after it). What the strategy adds around the
beats when the watchdog is on (an attribute test each, the closure wrapped for the optimizer step's beat) is
not in it; the overheads hold it. ``hook_s_by_hook`` splits ``hook_s_per_step`` by ``"Class.method"``. ``thread_cpu_added_s`` is what the "on" steps add to the training thread's own CPU
time (``time.thread_time``; mean over disjoint pairs, ``thread_cpu_added_se`` its standard error): the work that
runs on it, apart from the waits it causes on the other rank. Each fit gives the monitor a run directory of its own
(every "on" block is an attempt in its ledger). ``--switch watchdog`` or ``goodput`` switches one of the two (the
other stays out of the fit: ``hang_timeout=0``, no monitor); ``--switch none`` switches nothing, so its figures
are the design's own bias and noise.
``--processes N`` splits the rounds over N pairs of processes, each started afresh: ``overhead_by_processes``
holds each pair's mean and ``overhead_between_processes_se`` their standard error. Runs of the same code have
differed by more than ``overhead_se`` (0.0078 and 0.0027 at 40 rounds), which one pair cannot show.

Prints ``BENCH resilience {json}`` last and writes benchmarks/results/resilience.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
from _common import HookTime, emit, fit_arguments, fit_report, join_process_group, mean_se, run_workers
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything

from lightning_scale.callbacks import GoodputMonitor
from lightning_scale.data import TextDataModule
from lightning_scale.models import PRESETS, GPTLightningModule
from lightning_scale.strategies import HybridParallelStrategy

WORLD = 2
HANG_TIMEOUT = "auto"  # the strategy's default


class _Blocks(Callback):
    """Last in the callback list: each step's time into its block, and at the blocks' ends the switched callbacks
    (the goodput monitor) and, with ``watchdog``, the strategy's hang watchdog switched."""

    def __init__(
        self, switched: list[Callback], watchdog: bool, hooks: HookTime, block: int, warmup: int, on_first: bool
    ) -> None:
        self.switched, self.watchdog, self.hooks = switched, watchdog, hooks
        self.block, self.warmup, self.on = block, warmup, on_first
        self.blocks: list[tuple[bool, list[float]]] = []
        self.cpu: list[list[float]] = []  # each block's steps' CPU seconds on this thread (the training loop's)
        self.hook_s_on = 0.0  # the hooks' and beats' seconds in the steps run with them on
        self.by_hook_on: dict[str, float] = {}  # the same, by "Class.method"
        self._by_hook = dict(hooks.by_hook)  # HookTime's sums at the step before's end
        self.steps_on = 0
        self._last: float | None = None
        self._last_cpu = 0.0
        self._steps = 0
        self._new_block = True
        self._timed: Any = None  # the watchdog whose beats are timed

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # (The strategy starts its watchdog after the callbacks' on_train_start: it is switched at the first step's end.)
        if not self.on:
            for callback in self.switched:  # started by their own on_train_start: off first
                callback.on_train_end(trainer, pl_module)
            self._hold(trainer)

    def _hold(self, trainer: Trainer) -> None:
        """The Trainer holds the switched callbacks while they are on only: off, Lightning dispatches nothing to them
        (as without them), on, every hook of theirs it dispatches (first in the list)."""
        others = [c for c in trainer.callbacks if c not in self.switched]
        trainer.callbacks = [*self.switched, *others] if self.on else others

    def _switch_watchdog(self, trainer: Trainer) -> None:
        """The strategy's watchdog on or off as the block is; a new one's beats timed."""
        resilience = trainer.strategy.resilience
        resilience.switch_watchdog(self.on)
        if resilience.watchdog is not None and resilience.watchdog is not self._timed:
            self._timed = self.hooks.instrument_methods(resilience.watchdog, ("step_started", "entered"))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        if self._steps == 0 and self.watchdog:  # the fit's first step, never timed: the strategy's watchdog started
            self._switch_watchdog(trainer)
        first_of_block = self._steps % self.block == 0  # it may pay for the switch before it
        if self._last is not None and self._steps >= self.warmup and not first_of_block:
            if self._new_block:
                self.blocks.append((self.on, []))
                self.cpu.append([])
                self._new_block = False
            self.blocks[-1][1].append(now - self._last)
            self.cpu[-1].append(cpu - self._last_cpu)
            if self.on:  # the hooks' time in the steps timed (a block's first pays the monitor's "first_step" event)
                self.hook_s_on += self.hooks.seconds
                self.steps_on += 1
                for key, seconds in self.hooks.by_hook.items():
                    self.by_hook_on[key] = self.by_hook_on.get(key, 0.0) + seconds - self._by_hook.get(key, 0.0)
        self._steps += 1
        self.hooks.seconds, self._by_hook = 0.0, dict(self.hooks.by_hook)
        if self._steps % self.block == 0:  # the block's last step: switch for the next
            self.on, self._new_block = not self.on, True
            for callback in self.switched:
                (callback.on_train_start if self.on else callback.on_train_end)(trainer, pl_module)
            self._hold(trainer)
            if self.watchdog:
                self._switch_watchdog(trainer)
        self._last, self._last_cpu = time.perf_counter(), time.thread_time()


def _fit(args: argparse.Namespace, on_first: bool, run_dir: str) -> tuple[Any, ...]:
    """The fit's blocks (on?, step times), the hooks' and beats' seconds and the number of steps run with them on,
    and the blocks' steps' CPU seconds on the training thread, on this rank.
    ``run_dir``: the goodput monitor's, a fresh one per fit (each "on" block is an attempt of its ledger: one
    directory for every fit would grow it to hundreds of attempts, which no real run has)."""
    seed_everything(0, verbose=False)
    hooks = HookTime()
    goodput = hooks.instrument(GoodputMonitor(dirpath=run_dir))
    switched = [goodput] if args.switch in ("both", "goodput") else []
    watchdog = args.switch in ("both", "watchdog")
    blocks = _Blocks(switched, watchdog, hooks, args.block, args.warmup, on_first)
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=HybridParallelStrategy(data_parallel=WORLD, hang_timeout=HANG_TIMEOUT if watchdog else 0),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        callbacks=[*switched, blocks],
    )
    module = GPTLightningModule(PRESETS[args.preset])
    trainer.fit(module, datamodule=TextDataModule(seq_len=args.seq, global_batch_size=args.batch))
    return blocks.blocks, blocks.hook_s_on, blocks.steps_on, blocks.cpu, blocks.by_hook_on


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    join_process_group(rank, world, port)
    torch.set_num_threads(args.threads)
    fits = [_fit(args, r % 2 == 0, os.path.join(args.goodput_dir, f"{os.getpid()}-{r}")) for r in range(args.rounds)]
    if rank == 0:
        queue.put(fits)


def _overheads(pairs: Any) -> list[float]:
    """``on / off - 1`` of each pair of (on?, mean step) blocks that has one of each."""
    return [(a[1] / b[1] if a[0] else b[1] / a[1]) - 1 for a, b in pairs if a[0] != b[0]]


def _extra_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block", type=int, default=10, help="steps between two switches")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="pairs of processes the rounds are split over (each pair started afresh): the spread "
        "between them shows what differs from one process start to the next",
    )
    parser.add_argument(
        "--switch",
        default="both",
        choices=["both", "watchdog", "goodput", "none"],
        help="what the blocks switch: none is the control (on and off blocks alike), whose "
        "overhead is the design's own bias",
    )


def main() -> None:
    args = fit_arguments(
        __doc__,
        "resilience",
        rounds=3,
        steps=400,
        extra=_extra_arguments,
    )
    with tempfile.TemporaryDirectory() as ledger:  # the goodput monitor's run directory
        args.goodput_dir = ledger
        if not 1 <= args.processes <= args.rounds:
            raise SystemExit(f"--processes {args.processes} must be between 1 and --rounds {args.rounds}")
        shares = [args.rounds // args.processes + (i < args.rounds % args.processes) for i in range(args.processes)]
        started = [run_workers(_worker, WORLD, argparse.Namespace(**(vars(args) | {"rounds": n}))) for n in shares]
    pairs, disjoint, times, by_pair = [], [], {True: [], False: []}, []
    cpu_added, cpu = [], {True: [], False: []}  # the training thread's CPU seconds a step, on minus off
    for fits in started:
        pair_disjoint = []
        for blocks, _, _, cpu_blocks, _ in fits:
            means = [(on, statistics.mean(t)) for on, t in blocks if t]
            for (on, t), c in zip(blocks, cpu_blocks):
                times[on] += t
                cpu[on] += c
            cpu_means = [(on, statistics.mean(c)) for (on, _), c in zip(blocks, cpu_blocks) if c]
            cpu_added += [
                (a[1] - b[1]) * (1 if a[0] else -1) for a, b in zip(cpu_means[::2], cpu_means[1::2]) if a[0] != b[0]
            ]
            pairs += _overheads(zip(means, means[1:]))
            pair_disjoint += _overheads(zip(means[::2], means[1::2]))
        disjoint += pair_disjoint
        by_pair.append(statistics.mean(pair_disjoint))
    fits = [fit for group in started for fit in group]
    step = {"off": statistics.mean(times[False]), "on": statistics.mean(times[True])}
    overhead_mean, overhead_se = mean_se(disjoint)
    steps_on = max(1, sum(fit[2] for fit in fits))
    hook_s = sum(fit[1] for fit in fits) / steps_on  # per step with them on
    by_hook: dict[str, float] = {}  # the same by "Class.method"
    for fit in fits:
        for key, seconds in fit[4].items():
            by_hook[key] = by_hook.get(key, 0.0) + seconds / steps_on
    cpu_added_mean, cpu_added_se = mean_se(cpu_added)
    report = {
        **fit_report(args, WORLD),
        "block": args.block,
        # The strategy's watchdog's, when it is in the fit (the strategy's hang_timeout=0 otherwise).
        "hang_timeout": HANG_TIMEOUT if args.switch in ("both", "watchdog") else None,
        "switch": args.switch,  # what the "on" steps run: the watchdog, the goodput monitor, both, or none
        "step_s": step,
        "overhead_fraction": statistics.median(pairs),
        "block_pairs": len(pairs),
        "overhead_mean": overhead_mean,
        "overhead_se": overhead_se,
        "overhead_of_means": step["on"] / step["off"] - 1,
        "overhead_by_processes": by_pair,  # each pair of processes' mean (--processes)
        "overhead_between_processes_se": mean_se(by_pair)[1],
        "hook_s_per_step": hook_s,  # the monitor's hooks and the watchdog's beats, timed directly, a step on
        "hook_fraction": hook_s / step["off"],
        "hook_s_by_hook": dict(sorted(by_hook.items())),  # hook_s_per_step by "Class.method" (the beats: StepWatchdog)
        "thread_cpu_s": {"off": statistics.mean(cpu[False]), "on": statistics.mean(cpu[True])},
        "thread_cpu_added_s": cpu_added_mean,  # the training thread's CPU a step, on minus off (disjoint pairs)
        "thread_cpu_added_se": cpu_added_se,
    }
    emit("resilience", report, args.out)


if __name__ == "__main__":
    main()
