"""The package's GPU figures on one CUDA GPU, in one command (under 8 minutes on an H100/H200).

    python benchmarks/gpu_check.py                       # 350m and 1.3b presets, bf16
    python benchmarks/gpu_check.py --presets 350m --steps 20

For each preset, one process trains the GPT in bf16 (``MixedPrecision("bf16-mixed")``) under
``HybridParallelStrategy`` on the bundled corpus with the package's callbacks and reports, over the
steps after the warm-up:
- ``mfu``: model FLOPs utilisation against the GPU's dense bf16 peak (the datasheet table), with
  ``tokens_per_sec``: the physical bound is MFU 1;
- ``step_time``: ``StepTimeBreakdown``'s spans, timed by CUDA events (seconds per step);
- ``peak_allocated_gib`` / ``peak_reserved_gib``: ``MemoryMonitor``'s last interval;
- ``async_save_blocking_s`` against ``sync_save_s``: what an asynchronous sharded checkpoint of the
  whole training state (weights and AdamW moments, in GPU memory) blocks training for, and a
  synchronous save of the same state (the bound an async save should beat by far);
- ``joules_per_step``: NVML's energy counter over the timed steps (``None`` where NVML cannot read it);
- ``planner``: the planner's prediction for the same run (``results.json``'s record,
  :func:`lightning_scale.strategies.hybrid.planning.prediction_record`) against ``torch.cuda.max_memory_allocated``
  (``memory_error``), the measured step time (``step_time_error``) and MFU (``mfu_error``), with every
  predicted time and memory term and the planner's inputs, so one run calibrates it (the attention and
  elementwise terms beside ``step_time``'s measured spans say which rate is off).

On a machine without a CUDA GPU it says so, prints ``BENCH gpu_check {"skipped": ...}`` and exits 0.
Prints ``BENCH gpu_check {json}`` last and writes benchmarks/results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS, emit
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_scale.callbacks import MemoryMonitor, StepTimeBreakdown, Throughput
from lightning_scale.data import TextDataModule
from lightning_scale.models import PRESETS, GPTLightningModule
from lightning_scale.plugins import MixedPrecision, ShardedCheckpointIO
from lightning_scale.strategies import HybridParallelStrategy
from lightning_scale.strategies.hybrid.planning import prediction_record

_BATCH = {"350m": (16, 1024), "1.3b": (8, 2048)}  # (sequences, tokens each) per step on one GPU


class _Record(Callback):
    """The metrics at every step; NVML's energy at the end of the warm-up and of the run; the checkpoint saves."""

    def __init__(self, warmup: int, ckpt_dir: Path) -> None:
        self.warmup, self.ckpt_dir = warmup, ckpt_dir
        self.metrics: dict[str, float] = {}
        self.energy: list[tuple[int, float]] = []
        self.saves: dict[str, float] = {}
        self.peak_allocated_gib = 0.0  # the largest of MemoryMonitor's per-interval peaks (it resets the allocator's)
        self._nvml: Any = None

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:  # no NVML, or no energy counter on this GPU
            self._nvml = None

    def _joules(self) -> float | None:
        if self._nvml is None:
            return None
        import pynvml

        torch.cuda.synchronize()
        return pynvml.nvmlDeviceGetTotalEnergyConsumption(self._nvml) / 1000.0

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.warmup == 0:  # a logging step (every --warmup steps): MemoryMonitor has read and reset its peak
            interval = trainer.callback_metrics.get("memory/peak_allocated_gib")
            self.peak_allocated_gib = max(self.peak_allocated_gib, float(interval) if interval is not None else 0.0)
        if step in (self.warmup, trainer.max_steps):
            joules = self._joules()
            if joules is not None:
                self.energy.append((step, joules))
        if step == trainer.max_steps:
            self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            self._save(trainer)

    def _save(self, trainer: Trainer) -> None:
        io = trainer.strategy.checkpoint_io
        assert isinstance(io, ShardedCheckpointIO)
        for mode in ("sync", "async"):
            io.async_save = mode == "async"
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            begin = time.perf_counter()
            trainer.save_checkpoint(self.ckpt_dir / f"{mode}.ckpt")
            self.saves[f"{mode}_blocking_s"] = time.perf_counter() - begin
            io.wait()
            self.saves[f"{mode}_committed_s"] = time.perf_counter() - begin


def _run(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    batch, seq = _BATCH.get(preset, (8, PRESETS[preset].block_size))
    ckpt_dir = Path(tempfile.mkdtemp(prefix=f"gpu-check-{preset}-"))
    record = _Record(args.warmup, ckpt_dir)
    io = ShardedCheckpointIO(preemption=False, auto_resume=False)
    log_every = args.warmup  # logging steps at the warm-up's end and after; the last at max_steps
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=1,
        strategy=HybridParallelStrategy(checkpoint_io=io),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=log_every,
        plugins=[MixedPrecision("bf16-mixed")],
        callbacks=[Throughput(window=args.steps - args.warmup), StepTimeBreakdown(), MemoryMonitor(), record],
    )
    if args.accelerator == "gpu":
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer.fit(
            GPTLightningModule(PRESETS[preset]), datamodule=TextDataModule(seq_len=seq, global_batch_size=batch)
        )
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    m = record.metrics
    # The planner's figures for this very run, against the allocator's peak over the whole fit and the measured
    # throughput. MemoryMonitor resets the allocator's peak at each logging step, so the peak since the last one
    # alone (5.4 of 29 GiB on an H200, 2026-12-04) would miss the training steps before it.
    peak = (
        max(torch.cuda.max_memory_allocated(), record.peak_allocated_gib * 2**30) if args.accelerator == "gpu" else None
    )
    planned = prediction_record(trainer, m, peak) or {}
    joules = None
    if len(record.energy) == 2:
        (s0, j0), (s1, j1) = record.energy
        joules = (j1 - j0) / (s1 - s0)
    return {
        "batch": batch,
        "seq": seq,
        "tokens_per_sec": m.get("train/tokens_per_sec"),
        "mfu": m.get("train/mfu"),
        "achieved_tflops": m.get("train/achieved_tflops_per_device"),
        "step_time": {k.split("/")[-1]: v for k, v in m.items() if k.startswith("train/step_time/")},
        "peak_allocated_gib": m.get("memory/peak_allocated_gib"),
        "peak_reserved_gib": m.get("memory/peak_reserved_gib"),
        "async_save_blocking_s": record.saves.get("async_blocking_s"),
        "async_save_committed_s": record.saves.get("async_committed_s"),
        "sync_save_s": record.saves.get("sync_blocking_s"),
        "async_blocking_vs_sync": (
            record.saves["async_blocking_s"] / record.saves["sync_blocking_s"]
            if record.saves.get("sync_blocking_s")
            else None
        ),
        "joules_per_step": joules,
        "planner": {
            "layout": planned.get("layout"),
            "memory_gib": (planned.get("predicted") or {}).get("memory_per_device_bytes", 0) / 2**30,
            "max_memory_allocated_gib": None if peak is None else peak / 2**30,
            "memory_error": (planned.get("error") or {}).get("memory_per_device_bytes"),
            "step_time_s": (planned.get("predicted") or {}).get("step_time_s"),
            "step_time_error": (planned.get("error") or {}).get("step_time_s"),
            "efficiency": planned.get("efficiency"),
            "mfu": (planned.get("predicted") or {}).get("mfu"),
            "mfu_error": (planned["predicted"]["mfu"] / m["train/mfu"] - 1)
            if m.get("train/mfu") and planned.get("predicted")
            else None,
            # Every term beside the measured spans: compute, attention and elementwise (the per-operation rates),
            # the optimizer, what calibration refits (``lightning-scale-plan calibrate`` reads the same record).
            "time_terms": (planned.get("predicted") or {}).get("time_terms"),
            "memory_terms_gib": {
                k: v / 2**30 for k, v in ((planned.get("predicted") or {}).get("memory_terms") or {}).items()
            },
            "inputs": planned.get("inputs"),
            "problem": planned.get("error") if isinstance(planned.get("error"), str) else None,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["350m", "1.3b"], choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_check.json")
    parser.add_argument(
        "--accelerator",
        default="gpu",
        choices=("gpu", "cpu"),
        help="cpu: the same path on the CPU (with --presets tiny), to check the script itself",
    )
    args = parser.parse_args()
    if args.steps <= args.warmup or args.steps % args.warmup:
        parser.error(
            f"--steps {args.steps} must be a multiple of --warmup {args.warmup} above it (logging every --warmup steps)"
        )
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine; nothing to measure.", flush=True)
        emit("gpu_check", {"skipped": "no CUDA GPU"}, args.out)
        return 0
    start = time.perf_counter()
    device = torch.cuda.get_device_name() if args.accelerator == "gpu" else "cpu"
    report: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "steps": args.steps,
        "warmup": args.warmup,
        "precision": "bf16-mixed",
        "presets": {},
    }
    for preset in args.presets:
        report["presets"][preset] = _run(preset, args)
        if args.accelerator == "gpu":
            torch.cuda.empty_cache()
    report["wall_s"] = time.perf_counter() - start
    emit("gpu_check", report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
