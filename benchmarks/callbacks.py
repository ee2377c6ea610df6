"""What the telemetry callbacks cost a training step: the command line's default callbacks against none
and against Lightning's ThroughputMonitor, under the package's strategy at dp=2, interleaved in one fit.

    python benchmarks/callbacks.py                                # tiny GPT, 1,550 steps a fit, blocks of 50, 3 fits
    python benchmarks/callbacks.py --log-every 10 --steps 1210    # the command line's logging interval
    python benchmarks/callbacks.py --steps 500 --rounds 1

Two processes (gloo), ``HybridParallelStrategy(data_parallel=2)``, the tiny GPT on the bundled corpus,
``MixedPrecision("32-true")`` and gradient clipping at 1.0 (as the command line runs) in every variant:
- none: no callbacks (the strategy's own preemption callback and hang watchdog in every variant);
- ours: every callback of ``conf/callbacks/default.yaml`` but the checkpoint one, as the command line
  instantiates them (console, gradient norm, throughput, memory, cost, step time, stragglers, goodput);
- lightning: Lightning's ``ThroughputMonitor`` alone (with ``batch_size_fn`` and ``length_fn``).
Every callback of every variant is in the Trainer when the fit starts (so each sets itself up once, as in
real use: ``start_hooks_s`` reports that apart); from then on the fit runs in blocks of ``--log-every``
steps (the Trainer's ``log_every_n_steps``: Lightning's default of 50, or the command line's 10 with
``--log-every 10``; each block holds exactly one logging step, its last) and before each block the Trainer's callback list is set to that variant's callbacks. A cycle is
three adjacent blocks, one per variant, the order rotating from cycle to cycle. A step's time is the gap
between two ``on_train_batch_end`` calls on rank 0 (every callback's hooks, the logging steps'
collectives included); blocks starting inside the first ``--warmup`` steps and the first step of every
block are dropped, and a block's steps averaged (a median would hide the logging step).
``overhead_fraction = ours / none - 1`` and ``ratio_vs_throughput_monitor = ours / lightning`` are the
medians over cycles of each cycle's ratio (targets <= 0.01 and <= 1.01; the physical bound is no
overhead at all): a cycle lasts seconds, so a shared VM's drift between fits (several per cent, more
than the callbacks cost) cancels. The per-step hooks are also timed directly (summed per step, over
the steps their variant ran): ``hook_fraction`` is that time over the step of ``none``, and
``hook_ratio_vs_throughput_monitor`` the same comparison against ThroughputMonitor's hooks, timed alike.

Prints ``BENCH callbacks {json}`` last and writes benchmarks/results/callbacks.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ThroughputMonitor

from _common import HookTime, emit, fit_arguments, fit_report, join_process_group, run_workers

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
    return [instantiate(node, _convert_="all") for node in nodes.values()]


def _callbacks(variant: str, hooks: HookTime) -> list[Callback]:
    if variant == "ours":
        callbacks = _default_callbacks()
        for callback in callbacks:
            if type(callback).__name__ == "CostMonitor":
                callback.price_per_device_hour = 1.0  # a price, so cost/usd is computed (a CPU has none)
        return [hooks.instrument(c) for c in callbacks]
    if variant == "lightning":
        return [hooks.instrument(ThroughputMonitor(batch_size_fn=lambda b: b[0].shape[0], length_fn=lambda b: b[0].numel()))]
    return []


class _Blocks(Callback):
    """Last in the callback list: each step's time into its block, and at each block's end the Trainer's
    callbacks set to the next block's variant (both ranks alike: the logging steps' collectives match)."""

    def __init__(self, variants: dict[str, list[Callback]], hooks: dict[str, HookTime], block: int, warmup: int, steps: int) -> None:
        self.variants, self.hooks, self.block, self.warmup, self.steps = variants, hooks, block, warmup, steps
        self.blocks: list[tuple[int, str, list[float]]] = []  # (cycle, variant, step gaps)
        self.hook_s = {name: 0.0 for name in hooks}  # each variant's per-step hooks, summed over its steps
        self.steps_run = {name: 0 for name in VARIANTS}
        self._base: list[Callback] = []
        self._all: list[Callback] = []
        self._last: float | None = None
        self._step = 0

    def variant(self, step: int) -> tuple[int, str]:
        """The cycle and the variant of the block holding ``step`` (the order rotates from cycle to cycle)."""
        block = step // self.block
        cycle = block // len(VARIANTS)
        return cycle, VARIANTS[(block + cycle) % len(VARIANTS)]

    def _use(self, trainer: Trainer, variant: str) -> None:
        chosen = {id(c) for c in self.variants[variant]}
        trainer.callbacks = [*self._base, *[c for c in self._all if id(c) in chosen], self]

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        # Every variant's callbacks have had their setup and start hooks; the order is the one they set up in.
        self._all = [c for c in trainer.callbacks if c is not self]
        every = {id(c) for callbacks in self.variants.values() for c in callbacks}
        self._base = [c for c in self._all if id(c) not in every]
        self._use(trainer, self.variant(0)[1])

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        cycle, variant = self.variant(self._step)
        first_of_block = self._step % self.block == 0
        if first_of_block and self._step - self._step % self.block >= self.warmup:
            self.blocks.append((cycle, variant, []))
        elif self._last is not None and self.blocks and self.blocks[-1][:2] == (cycle, variant):
            self.blocks[-1][2].append(now - self._last)
        self.steps_run[variant] += 1
        for name, hooks in self.hooks.items():
            self.hook_s[name] += hooks.seconds
            hooks.seconds = 0.0
        self._step += 1
        if self._step >= self.steps:  # the last step: every callback back for the fit's end
            trainer.callbacks = [*self._all, self]
        elif self._step % self.block == 0:
            self._use(trainer, self.variant(self._step)[1])
        self._last = time.perf_counter()


def _fit(args: argparse.Namespace) -> tuple[_Blocks, dict[str, float]]:
    """One fit of all three variants in blocks; the blocks and each variant's start hooks' seconds, on this rank."""
    seed_everything(0, verbose=False)
    hooks = {name: HookTime() for name in ("ours", "lightning")}
    variants = {name: _callbacks(name, hooks.get(name, HookTime())) for name in VARIANTS}
    blocks = _Blocks(variants, hooks, args.log_every, args.warmup, args.steps)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, strategy=HybridParallelStrategy(data_parallel=WORLD), max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, gradient_clip_val=1.0, plugins=[MixedPrecision("32-true")],
        log_every_n_steps=args.log_every, callbacks=[*variants["ours"], *variants["lightning"], blocks],
    )  # fmt: skip
    module = GPTLightningModule(PRESETS[args.preset])
    trainer.fit(module, datamodule=TextDataModule(seq_len=args.seq, global_batch_size=args.batch))
    return blocks, {name: h.start_seconds for name, h in hooks.items()}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    join_process_group(rank, world, port)
    torch.set_num_threads(args.threads)
    fits = []
    for _ in range(args.rounds):
        blocks, start_s = _fit(args)
        fits.append(([(c, v, t) for c, v, t in blocks.blocks], blocks.hook_s, blocks.steps_run, start_s))
    if rank == 0:
        queue.put(fits)


def main() -> None:
    args = fit_arguments(
        __doc__, "callbacks", rounds=3, steps=1550, steps_help="optimizer steps per fit (a multiple of 3 blocks, plus warm-up)",
        extra=lambda p: p.add_argument("--log-every", type=int, default=50, help="log_every_n_steps (Lightning's default; the command line's is 10), and the block's length"),
    )  # fmt: skip
    fits = run_workers(_worker, WORLD, args)
    ratios: dict[str, list[float]] = {"none": [], "lightning": []}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    hook_s = {"ours": 0.0, "lightning": 0.0}
    steps_run = dict.fromkeys(VARIANTS, 0)
    for fit, (blocks, hooks, run, _) in enumerate(fits):
        cycles: dict[int, dict[str, float]] = {}
        for cycle, variant, gaps in blocks:
            if gaps:
                cycles.setdefault(cycle, {})[variant] = statistics.mean(gaps)
                times[variant] += gaps
        for means in cycles.values():
            if len(means) == len(VARIANTS):
                for other in ratios:
                    ratios[other].append(means["ours"] / means[other])
        for name in hook_s:
            hook_s[name] += hooks[name]
        for name in steps_run:
            steps_run[name] += run[name]
    if not ratios["none"]:
        raise SystemExit(f"no whole cycle of 3 blocks of {args.log_every} steps after the warm-up: raise --steps")
    step = {v: statistics.mean(times[v]) for v in VARIANTS}
    hooks_per_step = {name: hook_s[name] / max(1, steps_run[name]) for name in hook_s}
    report = {
        **fit_report(args, WORLD),
        "log_every_n_steps": args.log_every,
        "cycles": len(ratios["none"]),
        "step_s": step,
        "overhead_fraction": statistics.median(ratios["none"]) - 1,
        "overhead_quartiles": [q - 1 for q in statistics.quantiles(ratios["none"], n=4)] if len(ratios["none"]) > 1 else None,
        "overhead_of_means": step["ours"] / step["none"] - 1,
        "ratio_vs_throughput_monitor": statistics.median(ratios["lightning"]),
        "hook_s_per_step": hooks_per_step,
        "start_hooks_s": {name: statistics.median(f[3][name] for f in fits) for name in hook_s},
        "hook_fraction": hooks_per_step["ours"] / step["none"],
        "hook_ratio_vs_throughput_monitor": (step["none"] + hooks_per_step["ours"]) / (step["none"] + hooks_per_step["lightning"]),
    }
    emit("callbacks", report, args.out)


if __name__ == "__main__":
    main()
