"""The package's GPU figures on one CUDA GPU, in one command (under 8 minutes on an H100/H200).

    python benchmarks/gpu_check.py                       # 350m and 1.3b presets, bf16, eager and compiled
    python benchmarks/gpu_check.py --presets 350m --steps 20 --compile compiled
    python benchmarks/gpu_check.py --smoke               # the same code paths on the CPU, tiny, < 30 s

For each preset and each of eager and compiled (``HybridParallelStrategy(compile=...)``: per-block
``torch.compile``), one process trains the GPT in bf16 (``MixedPrecision("bf16-mixed")``) on the bundled
corpus with the package's callbacks and reports, over the steps after the warm-up:
- ``mfu``: model FLOPs utilisation against the GPU's dense bf16 peak (the datasheet table), with
  ``tokens_per_sec``: the physical bound is MFU 1; ``first_step_s`` (for a compiled run, the compile time is
  its excess over the eager run's: ``compile_s``);
- ``step_time``: ``StepTimeBreakdown``'s spans, timed by CUDA events (seconds per step);
- ``peak_allocated_gib`` / ``peak_reserved_gib``: ``MemoryMonitor``'s last interval;
- ``async_save_blocking_s`` against ``sync_save_s`` (each preset's last run): what an asynchronous sharded
  checkpoint of the whole training state (weights and AdamW moments, in GPU memory) blocks training for,
  the second one (``async_first_save_blocking_s``: the first, which allocates and pins the host buffers):
  until ``save_checkpoint`` returns, plus the GPU's wait for the device-to-host copies (a
  ``torch.cuda.synchronize()`` right after, the compute stream waits for the staging copies), against a
  synchronous save of the same state (the bound an async save should beat by far);
- ``joules_per_step``: NVML's energy counter over the timed steps (``None`` where NVML cannot read it);
- ``planner``: the planner's prediction for the same run (``results.json``'s record,
  :func:`lightning_scale.strategies.hybrid.planning.prediction_record`) against ``torch.cuda.max_memory_allocated``
  (``memory_error``), the measured step time (``step_time_error``) and MFU (``mfu_error``), with every
  predicted time and memory term and the planner's inputs, so one run calibrates it (the attention and
  elementwise terms beside ``step_time``'s measured spans say which rate is off).

The summary keys (issue 41): ``device``, ``driver``, ``torch``, ``mfu_350m``, ``mfu_1.3b`` (the compiled runs',
else the eager ones'), ``mfu_1.3b_fp8`` (the largest preset again with ``HybridParallelStrategy(float8="rowwise")``:
torchao float8 linears, compiled, where the GPU has float8 matmuls, compute capability >= 8.9; its MFU against the
bf16 peak like the others', and ``fp8_tokens_per_sec_ratio`` over the bf16 run; null elsewhere, with the reason in
``fp8_skipped``; ``--smoke`` runs it emulated on the CPU, eager), ``async_block_ratio``
(async blocking over the sync save, the largest preset's), ``planner_step_error`` and ``planner_memory_error``
(that preset's last run: predicted / measured - 1). ``runs`` holds every run with its full planner record and
``status``, which is what ``lightning-scale-plan calibrate benchmarks/results/gpu_check-....json`` reads (each
preset's primary run, the compiled one when both ran: ``calibrate: true``).

On a machine without a CUDA GPU (and without ``--smoke``) it says so, prints ``BENCH gpu_check {"skipped": ...}``
and exits 0. Prints ``BENCH gpu_check {json}`` last and writes it to
``benchmarks/results/gpu_check-<device>-<date>.json`` (``--out``: elsewhere).
"""

from __future__ import annotations

import argparse
import datetime
import re
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
_MODES = {"both": ("eager", "compiled"), "eager": ("eager",), "compiled": ("compiled",)}


class _Record(Callback):
    """The metrics at every step; NVML's energy at the end of the warm-up and of the run; the first step's time;
    the checkpoint saves (``save``: this run measures them)."""

    def __init__(self, warmup: int, ckpt_dir: Path, save: bool) -> None:
        self.warmup, self.ckpt_dir, self.save = warmup, ckpt_dir, save
        self.metrics: dict[str, float] = {}
        self.energy: list[tuple[int, float]] = []
        self.saves: dict[str, float] = {}
        self.peak_allocated_gib = 0.0  # the largest of MemoryMonitor's per-interval peaks (it resets the allocator's)
        self.first_step_s: float | None = None
        self._nvml: Any = None
        self._start = 0.0

    def on_fit_start(self, trainer: Trainer, pl_module: Any) -> None:
        self._nvml = _nvml_handle()

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        _synchronize()
        self._start = time.perf_counter()

    def _joules(self) -> float | None:
        if self._nvml is None:
            return None
        import pynvml

        torch.cuda.synchronize()
        return pynvml.nvmlDeviceGetTotalEnergyConsumption(self._nvml) / 1000.0

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == 1:  # for a compiled run, its blocks' compilation is in here
            _synchronize()
            self.first_step_s = time.perf_counter() - self._start
        if step % self.warmup == 0:  # a logging step (every --warmup steps): MemoryMonitor has read and reset its peak
            interval = trainer.callback_metrics.get("memory/peak_allocated_gib")
            self.peak_allocated_gib = max(self.peak_allocated_gib, float(interval) if interval is not None else 0.0)
        if step in (self.warmup, trainer.max_steps):
            joules = self._joules()
            if joules is not None:
                self.energy.append((step, joules))
        if step == trainer.max_steps:
            self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            if self.save:
                self._save(trainer)

    def _save(self, trainer: Trainer) -> None:
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, ShardedCheckpointIO):
            raise TypeError(f"gpu_check saves through ShardedCheckpointIO, not {type(io).__name__}")
        # The first async save allocates (and on CUDA pins) the host buffers; a run saves many times, so the
        # second, which refills them, is the one that counts.
        for mode in ("sync", "async_first", "async"):
            io.async_save = mode != "sync"
            _synchronize()
            begin = time.perf_counter()
            trainer.save_checkpoint(self.ckpt_dir / f"{mode}.ckpt")
            self.saves[f"{mode}_returned_s"] = time.perf_counter() - begin
            _synchronize()  # the GPU's own wait: the compute stream waits for the staging copies
            self.saves[f"{mode}_blocking_s"] = time.perf_counter() - begin
            io.wait()
            self.saves[f"{mode}_committed_s"] = time.perf_counter() - begin
            shutil.rmtree(self.ckpt_dir / f"{mode}.ckpt", ignore_errors=True)  # 1.3b's state is 21 GB


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _nvml_handle() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:  # no NVML, or no GPU
        return None


def _driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML
        return None


def _run(preset: str, mode: str, primary: bool, args: argparse.Namespace, float8: str | None = None) -> dict[str, Any]:
    """One fit of ``preset`` (``mode``: eager or compiled; ``float8``: torchao's recipe for the blocks' linears);
    the ``primary`` run of a preset also measures the checkpoint saves; it and a float8 run (whose planner record
    says float8) are the ones ``lightning-scale-plan calibrate`` fits to (``calibrate``)."""
    seed_everything(0, verbose=False)
    batch, seq = _BATCH.get(preset, (8, PRESETS[preset].block_size))
    ckpt_dir = Path(tempfile.mkdtemp(prefix=f"gpu-check-{preset}-"))
    record = _Record(args.warmup, ckpt_dir, primary and float8 is None)
    io = ShardedCheckpointIO(preemption=False, auto_resume=False)
    log_every = args.warmup  # logging steps at the warm-up's end and after; the last at max_steps
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=1,
        strategy=HybridParallelStrategy(checkpoint_io=io, compile=mode == "compiled", float8=float8),
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
    predicted = planned.get("predicted") or {}
    errors = planned.get("error") if isinstance(planned.get("error"), dict) else {}
    joules = None
    if len(record.energy) == 2:
        (s0, j0), (s1, j1) = record.energy
        joules = (j1 - j0) / (s1 - s0)
    saves = record.saves
    return {
        "preset": preset,
        "compile": mode,
        "float8": float8,
        "status": "completed" if m else "failed",
        # The planner's record does not say whether blocks were compiled: calibrate from one mode, the primary
        # (and the float8 run, in that mode on a GPU, whose record says float8: it fits the float8 speed-up).
        "calibrate": primary or float8 is not None,
        "batch": batch,
        "seq": seq,
        "tokens_per_sec": m.get("train/tokens_per_sec"),
        "mfu": m.get("train/mfu"),
        "achieved_tflops": m.get("train/achieved_tflops_per_device"),
        "first_step_s": record.first_step_s,
        "step_time": {k.split("/")[-1]: v for k, v in m.items() if k.startswith("train/step_time/")},
        "peak_allocated_gib": m.get("memory/peak_allocated_gib"),
        "peak_reserved_gib": m.get("memory/peak_reserved_gib"),
        "async_first_save_blocking_s": saves.get("async_first_blocking_s"),
        "async_save_returned_s": saves.get("async_returned_s"),
        "async_save_blocking_s": saves.get("async_blocking_s"),
        "async_save_committed_s": saves.get("async_committed_s"),
        "sync_save_s": saves.get("sync_blocking_s"),
        "async_blocking_vs_sync": (
            saves["async_blocking_s"] / saves["sync_blocking_s"] if saves.get("sync_blocking_s") else None
        ),
        "joules_per_step": joules,
        "planner": {
            "layout": planned.get("layout"),
            "memory_gib": predicted.get("memory_per_device_bytes", 0) / 2**30,
            "max_memory_allocated_gib": None if peak is None else peak / 2**30,
            "memory_error": errors.get("memory_per_device_bytes"),
            "step_time_s": predicted.get("step_time_s"),
            "step_time_error": errors.get("step_time_s"),
            "efficiency": planned.get("efficiency"),
            "mfu": predicted.get("mfu"),
            "mfu_error": (predicted["mfu"] / m["train/mfu"] - 1) if m.get("train/mfu") and predicted else None,
            # Every term beside the measured spans: compute, attention and elementwise (the per-operation rates),
            # the optimizer, what calibration refits (``lightning-scale-plan calibrate`` reads the same record).
            "time_terms": predicted.get("time_terms"),
            "memory_terms_gib": {k: v / 2**30 for k, v in (predicted.get("memory_terms") or {}).items()},
            "measured": planned.get("measured"),
            "inputs": planned.get("inputs"),
            "problem": planned.get("error") if isinstance(planned.get("error"), str) else None,
        },
    }


def summary(runs: list[dict[str, Any]], fp8_skipped: str | None = None) -> dict[str, Any]:
    """Issue 41's keys from the runs: each preset's MFU (compiled, else eager), the largest preset's async
    save ratio and planner errors (its last run: the compiled one when both ran); the float8 run's MFU
    (against the bf16 peak, as the bf16 runs': comparable) and tokens/s over its preset's primary run's
    (``fp8_tokens_per_sec_ratio``), or why there is none (``fp8_skipped``)."""
    fp8 = [r for r in runs if r.get("float8")]
    runs = [r for r in runs if not r.get("float8")]
    primary: dict[str, dict[str, Any]] = {}
    for run in runs:  # eager first, then compiled: the last run of a preset is its primary one
        primary[run["preset"]] = run
    out: dict[str, Any] = {f"mfu_{p}": primary[p]["mfu"] if p in primary else None for p in ("350m", "1.3b")}
    out["mfu_1.3b_fp8"] = None
    out["fp8_skipped"] = fp8_skipped
    for run in fp8:
        out[f"mfu_{run['preset']}_fp8"] = run["mfu"]
        base = primary.get(run["preset"], {}).get("tokens_per_sec")
        out["fp8_tokens_per_sec_ratio"] = run["tokens_per_sec"] / base if base and run["tokens_per_sec"] else None
    for run in runs:
        out[f"mfu_{run['preset']}_{run['compile']}"] = run["mfu"]
    eager = {r["preset"]: r for r in runs if r["compile"] == "eager"}
    for run in runs:
        if run["compile"] == "compiled" and run["preset"] in eager:
            first, base = run["first_step_s"], eager[run["preset"]]["first_step_s"]
            out[f"compile_s_{run['preset']}"] = None if first is None or base is None else first - base
    last = primary.get("1.3b") or list(primary.values())[-1]
    out["async_block_ratio"] = last["async_blocking_vs_sync"]
    out["planner_step_error"] = last["planner"]["step_time_error"]
    out["planner_memory_error"] = last["planner"]["memory_error"]
    return out


def _fp8_skipped(args: argparse.Namespace) -> str | None:
    """Why no float8 run (None: one runs): off by request, a GPU without float8 matmuls, no torchao."""
    import importlib.util

    from lightning_scale.strategies.hybrid.float8 import FLOAT8_MIN_CAPABILITY

    if args.fp8 == "off":
        return "--fp8 off"
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'lightning-scale[fp8]')"
    if args.accelerator == "gpu" and torch.cuda.get_device_capability() < FLOAT8_MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}) has no float8 matmuls (>= 8.9)"
    if args.accelerator == "cpu" and not args.smoke and args.fp8 == "auto":
        return "float8 is emulated on the CPU (--smoke runs it to check the path; no speed to measure)"
    return None


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=None, choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--compile", default=None, choices=sorted(_MODES), help="which runs per preset (default both)")
    parser.add_argument(
        "--out", type=Path, default=None, help="the JSON (default results/gpu_check-<device>-<date>.json)"
    )
    parser.add_argument(
        "--accelerator",
        default="gpu",
        choices=("gpu", "cpu"),
        help="cpu: the same path on the CPU (with --presets tiny), to check the script itself",
    )
    parser.add_argument(
        "--fp8",
        default="auto",
        choices=("auto", "on", "off"),
        help="also train the largest preset with float8 linears (torchao rowwise): auto where the GPU has float8 "
        "matmuls (compute capability >= 8.9), and under --smoke (emulated on the CPU)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="the same code paths on the CPU, tiny preset, eager and compiled (< 30 s)"
    )
    args = parser.parse_args()
    if args.smoke:
        args.accelerator = "cpu"
        defaults = {"presets": ["tiny"], "steps": 4, "warmup": 2, "compile": "both"}
    elif args.accelerator == "cpu":
        defaults = {"presets": ["tiny"], "steps": 4, "warmup": 2, "compile": "eager"}
    else:
        defaults = {"presets": ["350m", "1.3b"], "steps": 30, "warmup": 10, "compile": "both"}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps <= args.warmup or args.steps % args.warmup:
        parser.error(
            f"--steps {args.steps} must be a multiple of --warmup {args.warmup} above it (logging every --warmup steps)"
        )
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU on this machine; nothing to measure (--smoke runs the same paths on the CPU).",
            flush=True,
        )
        emit("gpu_check", {"skipped": "no CUDA GPU"}, args.out or RESULTS / "gpu_check.json")
        return 0
    start = time.perf_counter()
    device = torch.cuda.get_device_name() if args.accelerator == "gpu" else "cpu"
    date = datetime.date.today().isoformat()
    out = args.out or RESULTS / f"gpu_check-{_slug(device)}{'-smoke' if args.smoke else ''}-{date}.json"
    runs = []
    for preset in args.presets:
        modes = _MODES[args.compile]
        for mode in modes:
            runs.append(_run(preset, mode, mode == modes[-1], args))
            if args.accelerator == "gpu":
                torch.cuda.empty_cache()
    fp8_skipped = _fp8_skipped(args)
    if fp8_skipped is None:  # the largest preset again, its linears in float8 (emulated, eager, on the CPU)
        mode = _MODES[args.compile][-1] if args.accelerator == "gpu" else "eager"
        runs.append(_run(args.presets[-1], mode, False, args, float8="rowwise"))
    report: dict[str, Any] = {
        "device": device,
        "driver": _driver() if args.accelerator == "gpu" else None,
        "torch": torch.__version__,
        "date": date,
        "smoke": args.smoke,
        "steps": args.steps,
        "warmup": args.warmup,
        "precision": "bf16-mixed",
        **summary(runs, fp8_skipped),
        # Each preset's last run (compiled when both ran), as the script reported it before issue 41.
        "presets": {r["preset"]: r for r in runs if not r["float8"]},
        "runs": runs,
    }
    report["wall_s"] = time.perf_counter() - start
    emit("gpu_check", report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
