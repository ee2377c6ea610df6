"""What the telemetry callbacks cost a step: the command line's default callbacks against none
and against Lightning's ThroughputMonitor, under the package's strategy at dp=2, interleaved step by step in one fit.

    python benchmarks/callbacks.py                                # tiny GPT, 1,510 steps a fit, cycles of 150, 3 fits
    python benchmarks/callbacks.py --log-every 10 --steps 1210    # the command line's logging interval
    python benchmarks/callbacks.py --steps 500 --rounds 1

Two processes (gloo), ``HybridParallelStrategy(data_parallel=2)``, the tiny GPT on the bundled corpus,
``MixedPrecision("32-true")`` and gradient clipping at 1.0 (as the command line runs) in every variant:
- none: no callbacks (the strategy's own preemption callback and hang watchdog in every variant);
- ours: every callback of ``conf/callbacks/default.yaml`` but the checkpoint one, as the command line
  instantiates them (console, gradient norm, throughput, memory, cost, step time, stragglers, goodput), in
  one ``CallbackGroup`` as the command line dispatches them;
- lightning: Lightning's ``ThroughputMonitor`` alone (with ``batch_size_fn`` and ``length_fn``).
Every callback of every variant is in the Trainer when the fit starts (so each sets itself up once, as in
real use: ``start_hooks_s`` reports that apart). From then on the variant changes at every step: before each
step the Trainer's callback list is set to that step's variant's callbacks (and the precision plugin logs the
gradient norm on the steps of ``ours`` only, as GradNormMonitor asks it to). A cycle is three logging intervals
(``--log-every``, the Trainer's ``log_every_n_steps``: Lightning's default of 50, or the command line's 10);
within it the variants take turns step by step (none, ours, lightning, none, ... in even cycles, the other
way round in odd ones), each getting exactly one step at every position of an interval, the logging position
included. So each variant runs one logging step per ``--log-every`` of its own
steps, as in real use, and a slowdown of the machine lasting a second or more falls on all three alike.
A step's time is the gap between two ``on_train_batch_end`` calls on rank 0 (every callback's hooks, the
logging steps' collectives included, and Lightning's work after the previous step); cycles starting inside
the first ``--warmup`` steps are dropped, and a cycle's steps of one variant averaged (a median would hide
the logging step). Per cycle, ``ours / none - 1`` and ``ours / lightning``:
``overhead_fraction`` and ``ratio_vs_throughput_monitor`` are their medians over cycles (targets <= 0.01 and
<= 1.01; the physical bound is no overhead at all), ``overhead_mean`` and ``ratio_vs_throughput_monitor_mean``
their means with the standard errors ``overhead_se`` and ``ratio_vs_throughput_monitor_se`` (the cycles'
standard deviation over the square root of their number), the precision of the comparison within one pair
of processes. Every round runs in two processes of their own, since the overhead changes from one process
start to the next by more than that (0.5 to 2% on the same code, 2026-12-04: cold-cache costs depend on where
things land in memory): ``overhead_by_round`` and ``ratio_vs_throughput_monitor_by_round`` are each round's
mean, ``overhead_between_rounds_se`` their standard error, the honest precision of the mean. With
``--time-hooks`` the per-step hooks are also timed directly (summed per step, over the steps their variant
ran; a wrapper around each, whose own cost then lands in the step times): ``hook_fraction`` is that time over
the step of ``none``, ``hook_ratio_vs_throughput_monitor`` the same comparison against ThroughputMonitor's
hooks, timed alike, and ``hook_us_per_step_by_hook`` each hook's share (of ``ours``: the group's hooks, which record
the step once for the telemetry members and call the console and the gradient-norm monitor). Left in every variant (ours, set up once per fit): StepTimeBreakdown's
timing wrapper around ``torch.distributed``'s Python collectives (two calls a step, microseconds) and the
goodput monitor's thread, which rewrites a small file once a second.

Prints ``BENCH callbacks {json}`` last and writes benchmarks/results/callbacks.json.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from typing import Any

import torch
from _common import HookTime, emit, fit_arguments, fit_report, join_process_group, mean_se, run_workers
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ThroughputMonitor

from lightning_scale.callbacks.group import CallbackGroup, group_callbacks
from lightning_scale.data import TextDataModule
from lightning_scale.models import PRESETS, GPTLightningModule
from lightning_scale.plugins import MixedPrecision
from lightning_scale.strategies import HybridParallelStrategy

WORLD = 2
VARIANTS = ("none", "ours", "lightning")


def _default_callbacks() -> list[Callback]:
    """The command line's default callbacks (conf/callbacks/default.yaml) but the checkpoint one."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    GlobalHydra.instance().clear()
    run_dir = tempfile.mkdtemp(prefix="callbacks-bench-")  # where the goodput ledger goes, as a run's would
    with initialize_config_module("lightning_scale.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"run_dir={run_dir}"])
    nodes = {name: node for name, node in cfg.callbacks.items() if name != "checkpoint"}
    return group_callbacks([instantiate(node, _convert_="all") for node in nodes.values()])  # as the command line does


def _callbacks(variant: str, hooks: HookTime) -> list[Callback]:
    if variant == "ours":
        callbacks = _default_callbacks()
        for group in callbacks:
            for callback in group.callbacks if isinstance(group, CallbackGroup) else [group]:
                if type(callback).__name__ == "CostMonitor":
                    callback.price_per_device_hour = 1.0  # a price, so cost/usd is computed (a CPU has none)
            hooks.instrument(group)  # the group's hooks: its step records and the members it calls
        return callbacks
    if variant == "lightning":
        return [
            hooks.instrument(ThroughputMonitor(batch_size_fn=lambda b: b[0].shape[0], length_fn=lambda b: b[0].numel()))
        ]
    return []


class _Interleave(Callback):
    """Last in the callback list: each step's time into its cycle and variant, and after each step the
    Trainer's callbacks set to the next step's variant (both ranks alike: the logging steps' collectives match)."""

    def __init__(
        self, variants: dict[str, list[Callback]], hooks: dict[str, HookTime], every: int, warmup: int, steps: int
    ) -> None:
        self.variants, self.hooks, self.every, self.warmup, self.steps = variants, hooks, every, warmup, steps
        self.gaps: dict[int, dict[str, list[float]]] = {}  # cycle -> variant -> step gaps
        self.hook_s = {name: 0.0 for name in hooks}  # each variant's per-step hooks, summed over its steps
        self.steps_run = {name: 0 for name in VARIANTS}
        self._base: list[Callback] = []
        self._all: list[Callback] = []
        self._last: float | None = None
        self._step = 0
        self._current = VARIANTS[0]
        self.gc_s = dict.fromkeys(VARIANTS, 0.0)  # the garbage collector's pauses in each variant's steps
        self.gc_runs = {name: [0, 0, 0] for name in VARIANTS}  # its collections there, by generation
        self._gc_start = 0.0
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_s[self._current] += time.perf_counter() - self._gc_start
            self.gc_runs[self._current][info["generation"]] += 1

    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        gc.callbacks.remove(self._gc)

    def variant(self, step: int) -> tuple[int, str]:
        """The cycle and the variant of (0-based) ``step``. In interval ``j`` of a cycle (3 intervals of
        ``every`` steps), position ``i`` goes to variant ``(j + (i + 1 - every)) mod 3`` in even cycles and
        ``(j - (i + 1 - every)) mod 3`` in odd ones: each position goes to each variant once a cycle, the logging
        position (``every - 1``, where Lightning logs) to variant ``j``, and over two cycles each variant
        follows each other one equally often (whatever a step leaves to the next falls alike)."""
        interval, position = divmod(step, self.every)
        cycle, j = divmod(interval, len(VARIANTS))
        offset = (position + 1 - self.every) * (1 if cycle % 2 == 0 else -1)
        return cycle, VARIANTS[(j + offset) % len(VARIANTS)]

    def _use(self, trainer: Trainer, variant: str) -> None:
        self._current = variant
        chosen = {id(c) for c in self.variants[variant]}
        trainer.callbacks = [*self._base, *[c for c in self._all if id(c) in chosen], self]
        trainer.precision_plugin.log_grad_norm = variant == "ours"  # what GradNormMonitor's setup asked for

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        # Every variant's callbacks have had their setup and start hooks; the order is the one they set up in.
        self._all = [c for c in trainer.callbacks if c is not self]
        every = {id(c) for callbacks in self.variants.values() for c in callbacks}
        self._base = [c for c in self._all if id(c) not in every]
        self._use(trainer, self.variant(0)[1])

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        cycle, variant = self.variant(self._step)
        if self._last is not None and cycle * self.every * len(VARIANTS) >= self.warmup:
            self.gaps.setdefault(cycle, {}).setdefault(variant, []).append(now - self._last)
        self.steps_run[variant] += 1
        for name, hooks in self.hooks.items():
            self.hook_s[name] += hooks.seconds
            hooks.seconds = 0.0
        self._step += 1
        if self._step >= self.steps:  # the last step: every callback back for the fit's end
            trainer.callbacks = [*self._all, self]
            trainer.precision_plugin.log_grad_norm = True
        else:
            self._use(trainer, self.variant(self._step)[1])
        self._last = time.perf_counter()


def _fit(args: argparse.Namespace) -> tuple[_Interleave, dict[str, float]]:
    """One fit of all three variants interleaved; the step times and each variant's start hooks' seconds, on this rank."""
    seed_everything(0, verbose=False)
    hooks = {name: HookTime(per_step=args.time_hooks) for name in ("ours", "lightning")}
    variants = {name: _callbacks(name, hooks.get(name, HookTime())) for name in VARIANTS}
    interleave = _Interleave(variants, hooks, args.log_every, args.warmup, args.steps)
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=HybridParallelStrategy(data_parallel=WORLD),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        plugins=[MixedPrecision("32-true")],
        log_every_n_steps=args.log_every,
        callbacks=[*variants["ours"], *variants["lightning"], interleave],
    )
    module = GPTLightningModule(PRESETS[args.preset])
    trainer.fit(module, datamodule=TextDataModule(seq_len=args.seq, global_batch_size=args.batch))
    return interleave, {name: h.start_seconds for name, h in hooks.items()}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    join_process_group(rank, world, port)
    torch.set_num_threads(args.threads)
    fits = []
    for _ in range(args.rounds):
        interleave, start_s = _fit(args)
        fits.append(
            (
                interleave.gaps,
                interleave.hook_s,
                interleave.steps_run,
                start_s,
                interleave.gc_s,
                interleave.gc_runs,
                interleave.hooks["ours"].by_hook,
            )
        )
    if rank == 0:
        queue.put(fits)


def main() -> None:
    args = fit_arguments(
        __doc__,
        "callbacks",
        rounds=3,
        steps=1510,
        steps_help="optimizer steps per fit (cycles of 3 logging intervals, plus warm-up)",
        extra=lambda p: (
            p.add_argument(
                "--log-every",
                type=int,
                default=50,
                help="log_every_n_steps (Lightning's default; the command line's is 10); a cycle is 3 of them",
            ),
            p.add_argument(
                "--time-hooks",
                action="store_true",
                help="also time every per-step hook (a wrapper each: the overhead then includes them)",
            ),
        ),
    )
    # Each round in two processes of their own: what differs from one process start to the next (the memory
    # layout the caches see) then shows in the spread over rounds, which the cycles of one round cannot show.
    fits = [
        fit
        for _ in range(args.rounds)
        for fit in run_workers(_worker, WORLD, argparse.Namespace(**(vars(args) | {"rounds": 1})))
    ]
    by_round: dict[str, list[float]] = {"none": [], "lightning": []}  # each round's mean of its cycles' ratios
    ratios: dict[str, list[float]] = {"none": [], "lightning": []}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    hook_s = {"ours": 0.0, "lightning": 0.0}
    steps_run = dict.fromkeys(VARIANTS, 0)
    gc_s = dict.fromkeys(VARIANTS, 0.0)
    gc_runs = {name: [0, 0, 0] for name in VARIANTS}
    by_hook: dict[str, float] = {}
    for gaps, hooks, run, _, gc_seconds, gc_counts, hook_split in fits:
        for key, seconds in hook_split.items():
            by_hook[key] = by_hook.get(key, 0.0) + seconds
        for name in VARIANTS:
            gc_s[name] += gc_seconds[name]
            gc_runs[name] = [a + b for a, b in zip(gc_runs[name], gc_counts[name])]
        round_ratios: dict[str, list[float]] = {"none": [], "lightning": []}
        for cycle in gaps.values():
            if all(len(cycle.get(v, [])) == args.log_every for v in VARIANTS):  # whole cycles only
                means = {v: statistics.mean(cycle[v]) for v in VARIANTS}
                for other in ratios:
                    ratios[other].append(means["ours"] / means[other])
                    round_ratios[other].append(means["ours"] / means[other])
                for v in VARIANTS:
                    times[v] += cycle[v]
        for other, values in round_ratios.items():
            if values:
                by_round[other].append(statistics.mean(values))
        for name in hook_s:
            hook_s[name] += hooks[name]
        for name in steps_run:
            steps_run[name] += run[name]
    if not ratios["none"]:
        raise SystemExit(f"no whole cycle of 3 x {args.log_every} steps after the warm-up: raise --steps")
    step = {v: statistics.mean(times[v]) for v in VARIANTS}
    hooks_per_step = {name: hook_s[name] / max(1, steps_run[name]) for name in hook_s}
    overhead_mean, overhead_se = mean_se([r - 1 for r in ratios["none"]])
    ratio_mean, ratio_se = mean_se(ratios["lightning"])
    report = {
        **fit_report(args, WORLD),
        "log_every_n_steps": args.log_every,
        "cycles": len(ratios["none"]),
        "step_s": step,
        "overhead_fraction": statistics.median(ratios["none"]) - 1,
        "overhead_quartiles": [q - 1 for q in statistics.quantiles(ratios["none"], n=4)]
        if len(ratios["none"]) > 1
        else None,
        "overhead_mean": overhead_mean,
        "overhead_se": overhead_se,
        "overhead_of_means": step["ours"] / step["none"] - 1,
        "overhead_by_round": [r - 1 for r in by_round["none"]],
        "overhead_between_rounds_se": mean_se([r - 1 for r in by_round["none"]])[1],
        "ratio_vs_throughput_monitor_by_round": by_round["lightning"],
        "ratio_vs_throughput_monitor": statistics.median(ratios["lightning"]),
        "ratio_vs_throughput_monitor_mean": ratio_mean,
        "ratio_vs_throughput_monitor_se": ratio_se,
        "start_hooks_s": {name: statistics.median(f[3][name] for f in fits) for name in hook_s},
        "gc_s_per_step": {name: gc_s[name] / max(1, steps_run[name]) for name in VARIANTS},
        "gc_collections": gc_runs,
        "hooks_timed": args.time_hooks,
    }
    if args.time_hooks:
        report |= {
            "hook_s_per_step": hooks_per_step,
            "hook_fraction": hooks_per_step["ours"] / step["none"],
            "hook_ratio_vs_throughput_monitor": (step["none"] + hooks_per_step["ours"])
            / (step["none"] + hooks_per_step["lightning"]),
            "hook_us_per_step_by_hook": {
                k: round(v / max(1, steps_run["ours"]) * 1e6, 1)
                for k, v in sorted(by_hook.items(), key=lambda kv: -kv[1])
            },
        }
    emit("callbacks", report, args.out)


if __name__ == "__main__":
    main()
