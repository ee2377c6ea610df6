"""What the telemetry callbacks cost a training step: the command line's default callbacks against none
and against Lightning's ThroughputMonitor, under the package's strategy at dp=2.

    python benchmarks/callbacks.py                      # tiny GPT, 200 steps a fit, 5 rounds
    python benchmarks/callbacks.py --steps 60 --rounds 1

Two processes (gloo), ``HybridParallelStrategy(data_parallel=2)``, the tiny GPT on the bundled corpus,
``MixedPrecision("32-true")`` and gradient clipping at 1.0 (as the command line runs) in every variant,
Lightning's default ``log_every_n_steps=50``:
- none: no callbacks (the strategy's own preemption callback and hang watchdog in every variant);
- ours: every callback of ``conf/callbacks/default.yaml`` but the checkpoint one, as the command line
  instantiates them (console, gradient norm, throughput, memory, cost, step time, stragglers);
- lightning: Lightning's ``ThroughputMonitor`` alone (with ``batch_size_fn`` and ``length_fn``).
Each round fits each variant once in the same two processes (the order rotating); a step's time is the
gap between two ``on_train_batch_end`` calls on rank 0 (every callback's hooks, the logging steps'
collectives included); the first ``--warmup`` steps of a fit are dropped and the rest averaged (a
median would hide the logging steps). ``overhead_fraction = ours / none - 1`` and
``ratio_vs_throughput_monitor = ours / lightning`` are the medians over rounds of each round's ratio
(targets <= 0.01 and <= 1.01; the physical bound is no overhead at all). On a shared VM a step's time
moves by several per cent between fits, more than the callbacks cost, so the run also times the
callbacks' per-step hooks directly (summed per step; the once-per-fit start, ``start_hooks_s``,
apart): ``hook_fraction`` is that time over the step, the overhead without the noise (it leaves out cache effects), and
``hook_ratio_vs_throughput_monitor`` the same comparison against ThroughputMonitor's hooks, timed alike.

Prints ``BENCH callbacks {json}`` last and writes benchmarks/results/callbacks.json.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ThroughputMonitor

from _common import BatchEndGaps, HookTime, emit, fit_arguments, fit_report, join_process_group, run_workers

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
    with initialize_config_module("lightning_scale.conf", version_base="1.3"):
        cfg = compose("config", overrides=["run_dir=unused"])
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


def _fit(variant: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """Mean seconds per step after the warm-up, the per-step hooks' seconds per step (whole fit) and the
    start hooks' seconds, on this rank."""
    seed_everything(0, verbose=False)
    gaps, hooks = BatchEndGaps(), HookTime()
    trainer = Trainer(
        accelerator="cpu", devices=WORLD, strategy=HybridParallelStrategy(data_parallel=WORLD), max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, gradient_clip_val=1.0, plugins=[MixedPrecision("32-true")],
        callbacks=[*_callbacks(variant, hooks), gaps],
    )  # fmt: skip
    module = GPTLightningModule(PRESETS[args.preset])
    trainer.fit(module, datamodule=TextDataModule(seq_len=args.seq, global_batch_size=args.batch))
    steps = gaps.steps(args.warmup)
    return sum(steps) / len(steps), hooks.seconds / args.steps, hooks.start_seconds


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    join_process_group(rank, world, port)
    torch.set_num_threads(args.threads)
    means: dict[str, list[float]] = {v: [] for v in VARIANTS}
    hook_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    start_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % 3:] + VARIANTS[: r % 3]
        for variant in order:
            mean, hooks, start = _fit(variant, args)
            means[variant].append(mean)
            hook_s[variant].append(hooks)
            start_s[variant].append(start)
    if rank == 0:
        queue.put((means, hook_s, start_s))


def main() -> None:
    args = fit_arguments(__doc__, "callbacks", rounds=5, steps_help="optimizer steps per fit (4 logging steps at 200)")
    means, hook_s, start_s = run_workers(_worker, WORLD, args)
    hooks = {v: statistics.median(hook_s[v]) for v in ("ours", "lightning")}
    step = {v: statistics.median(means[v]) for v in VARIANTS}
    ratio = {v: statistics.median(o / b for o, b in zip(means["ours"], means[v])) for v in ("none", "lightning")}
    report = {
        **fit_report(args, WORLD),
        "log_every_n_steps": 50,
        "step_s": step,
        "overhead_fraction": ratio["none"] - 1,
        "overhead_by_round": [o / b - 1 for o, b in zip(means["ours"], means["none"])],
        "overhead_of_medians": step["ours"] / step["none"] - 1,
        "ratio_vs_throughput_monitor": ratio["lightning"],
        "hook_s_per_step": hooks,
        "start_hooks_s": {v: statistics.median(start_s[v]) for v in ("ours", "lightning")},
        "hook_fraction": hooks["ours"] / step["none"],
        "hook_ratio_vs_throughput_monitor": (step["none"] + hooks["ours"]) / (step["none"] + hooks["lightning"]),
    }
    emit("callbacks", report, args.out)


if __name__ == "__main__":
    main()
