"""What a run leaves behind for a study: ``results.json`` (one run, or one job of a sweep; the one
definition of its name, :data:`RESULTS_FILE`, and of the files beside it), each rank's peak memory, the
loss curves and ``metrics.csv``'s earlier rows of a resumed run, the environment it ran on (logged to
wandb at the start), and reading a study's results back. May import from ``cli`` only ``environment``
and ``job_config`` (see ``cli/__init__.py``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig, OmegaConf

from lightning_scale._lightning_compat import wandb_run_started
from lightning_scale.callbacks.group import each_callback
from lightning_scale.callbacks.run_record import CsvHistory, ValidationRecord
from lightning_scale.callbacks.sync import SyncMonitor
from lightning_scale.cli.job_config import config_fingerprint, layout_of
from lightning_scale.core.planner import Candidate
from lightning_scale.strategies.hybrid.planning import prediction_record

__all__ = [
    "CsvHistory",
    "JOB_FILE",
    "RESULTS_FILE",
    "STATUSES",
    "SUMMARY_FILE",
    "SUMMARY_METRICS",
    "ValidationRecord",
    "collect_results",
    "describe_totals",
    "environment",
    "finish_wandb",
    "job_results",
    "log_config",
    "num_parameters",
    "peak_memory",
    "read_json",
    "study_totals",
    "sync_record",
    "write_json",
]

RESULTS_FILE = "results.json"
"""A run's (or a sweep job's) record: what a study's report compares (:func:`job_results`)."""
SUMMARY_FILE = "summary.json"
"""A run's summary: losses, steps, the telemetry's last values."""
JOB_FILE = "job.json"
"""A sweep job's (or a run's) record of itself: wandb run id, attempt, checkpoint resumed from."""
STATUSES = ("completed", "skipped", "failed")

SUMMARY_METRICS = (
    "train/tokens_per_sec",
    "train/tokens_per_sec_per_device",
    "train/mfu",
    "train/hfu",
    "train/achieved_tflops_per_device",
    "train/peak_flops_measured",
    "memory/peak_allocated_gib",
    "memory/peak_reserved_gib",
    "memory/peak_rss_gib",
    "cost/usd",
    "cost/usd_per_1m_tokens",
    "cost/usd_to_target",
    "cost/hours_to_target",
    "energy/kwh",
    "train/step_time/total",
    "train/step_time/sync",
    "train/sync/bytes_per_step",
    "train/sync/exchanges_per_step",
    "train/sync/bytes_total",
    "plan/step_time",
    "plan/memory_per_device_gib",
    "plan/tokens_per_sec",
    "plan/mfu",
)
"""The telemetry callbacks' metrics whose last values go into ``summary.json``."""


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    """Write ``doc`` to ``path`` whole or not at all (a temporary file, then renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """``path``'s JSON document, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect_results(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every job's ``results.json`` under ``sweep_dir``, in job order, each with its ``job_dir``."""
    found = []
    for path in sorted(Path(sweep_dir).rglob(RESULTS_FILE)):
        if any(part.startswith(".") for part in path.relative_to(sweep_dir).parts):
            continue
        doc = read_json(path)
        if doc is not None:
            found.append({**doc, "job_dir": str(path.parent)})
    return sorted(
        found, key=lambda d: (d.get("job") is None, d.get("job") if isinstance(d.get("job"), int) else 0, d["job_dir"])
    )


def study_totals(jobs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What a study cost, over its jobs that ran (completed, or failed after running): ``device_hours``
    (each job's elapsed time x its devices), ``job_hours`` (the jobs' elapsed times added: the wall time
    of a sweep that runs them one after another), ``usd`` (the jobs' recorded cost, ``None`` when no job
    recorded one) and ``priced_jobs`` of ``jobs_run``."""
    ran = [j for j in jobs if isinstance(j.get("elapsed_s"), (int, float))]
    priced = [j for j in ran if isinstance(j.get("usd"), (int, float))]
    return {
        "jobs_run": len(ran),
        "device_hours": sum(float(j["elapsed_s"]) * int(j.get("world_size") or 1) for j in ran) / 3600,
        "job_hours": sum(float(j["elapsed_s"]) for j in ran) / 3600,
        "usd": sum(float(j["usd"]) for j in priced) if priced else None,
        "priced_jobs": len(priced),
    }


def describe_totals(totals: Mapping[str, Any]) -> str:
    """One line for a study's totals (:func:`study_totals`)."""
    usd = (
        f"${totals['usd']:,.2f} ({totals['priced_jobs']} of {totals['jobs_run']} jobs priced)"
        if totals["usd"] is not None
        else "no cost recorded (no price for the device)"
    )
    return (
        f"{totals['jobs_run']} jobs ran: {totals['device_hours']:.3g} device-hours, "
        f"{totals['job_hours']:.3g} h of jobs, {usd}"
    )


def num_parameters(module: LightningModule) -> int:
    """The whole model's parameter count, whether it is built yet or not, at any layout (counted on
    the meta device: a pipeline stage or a shard would count only its part)."""
    from lightning_scale.models import GPT, GPTConfig

    config = getattr(module, "config", None)
    if not isinstance(config, GPTConfig):
        return sum(p.numel() for p in module.parameters())
    with torch.device("meta"):
        return GPT(config).num_parameters()


def finish_wandb(trainer: Trainer) -> None:
    """Close this job's wandb run: ``WandbLogger`` never does, so in a multirun every later job
    would log into the first job's run."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and trainer.is_global_zero and wandb_run_started(logger):
            logger.experiment.finish()


def peak_memory(trainer: Trainer) -> list[int]:
    """Each rank's peak memory in bytes: CUDA's peak allocation on GPUs, the process's peak
    resident set elsewhere (gathered over all ranks)."""
    device = trainer.strategy.root_device
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [int(peak)]
    values = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([peak], dtype=torch.int64, device=device))
    return [int(v.item()) for v in values]


def sync_record(trainer: Trainer) -> dict[str, Any] | None:
    """The data-parallel exchange over the whole run (:attr:`~lightning_scale.callbacks.SyncMonitor.summary`: mode, H,
    bytes sent, exchanges, seconds blocked, training seconds, and ``[step, training s, bytes]`` at each validation;
    means over the processes), or None without a ``SyncMonitor`` or a strategy that counts them."""
    return next((c.summary for c in each_callback(trainer) if isinstance(c, SyncMonitor) and c.summary), None)


def job_results(
    cfg: DictConfig, summary: dict[str, Any], record: Any, trainer: Trainer, datamodule: Any, peaks: list[int]
) -> dict[str, Any]:
    """``results.json``: what a sweep's report compares, for one run or one job of a sweep."""
    job = cast(dict, OmegaConf.to_container(cfg.job, resolve=True)) if cfg.get("job") is not None else {}
    plain = cast(dict, OmegaConf.to_container(cfg, resolve=True))
    layout = job.get("layout") or layout_of(plain)
    vals = [loss for _, loss in record.val_curve] + [
        summary[k] for k in ("initial_val_loss", "final_val_loss") if summary.get(k) is not None
    ]
    throughput_on = any(type(c).__name__ == "Throughput" for c in each_callback(trainer))
    cost = (cfg.get("callbacks") or {}).get("cost") or {}
    planned = prediction_record(trainer, summary, max(peaks) if trainer.strategy.root_device.type == "cuda" else None)
    if planned and planned.get("chosen_by") == "auto":  # the layout the planner chose, as a sweep names layouts
        c = Candidate(**planned["inputs"]["candidate"])
        layout = {
            "name": c.layout,
            "dp": c.dp,
            "tp": c.tp,
            "pp": c.pp,
            "mode": c.dp_mode,
            "world_size": trainer.world_size,
            "chosen_by": "auto",
        }
    return {
        "status": "completed",
        "study": cfg.get("study"),
        "job": job.get("num"),
        "layout": layout["name"],
        "layout_sizes": layout,
        "overrides": job.get("overrides", []),
        "config_fingerprint": job.get("fingerprint") or config_fingerprint(plain),
        "precision": str(trainer.precision),
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "accelerator": trainer.strategy.root_device.type,
        # CPU runs: each process's intra-op threads (processes x threads over the cores: oversubscribed?).
        "threads_per_process": torch.get_num_threads(),
        "global_batch_size": datamodule.global_batch_size,
        "seq_len": datamodule.seq_len,
        "global_step": trainer.global_step,
        "elapsed_s": summary.get("elapsed_s"),
        "tokens_per_sec": summary.get("train/tokens_per_sec"),
        "tokens_per_sec_per_device": summary.get("train/tokens_per_sec_per_device"),
        "mfu": summary.get("train/mfu"),
        "usd": summary.get("cost/usd"),
        "usd_per_1m_tokens": summary.get("cost/usd_per_1m_tokens"),
        "peak_memory_bytes": max(peaks),
        "peak_memory_bytes_per_rank": peaks,
        "peak_memory_kind": "cuda_max_allocated" if trainer.strategy.root_device.type == "cuda" else "host_max_rss",
        "final_val_loss": summary.get("final_val_loss"),
        "best_val_loss": min(vals) if vals else None,
        "final_train_loss": summary.get("final_train_loss"),
        "target_loss": cost.get("target_loss"),
        "hours_to_target": summary.get("cost/hours_to_target"),
        "usd_to_target": summary.get("cost/usd_to_target"),
        "wandb_run_id": job.get("wandb_run_id"),
        "resumed_from": job.get("resumed_from"),
        "attempt": job.get("attempt", 0),
        # Where the wall time went across every attempt (GoodputMonitor): goodput = productive_s / total_s.
        "goodput": summary.get("goodput"),
        # What the data-parallel exchange sent (SyncMonitor): what the report plots validation loss against.
        "sync": sync_record(trainer),
        # Why tokens_per_sec may be null: "off" (no Throughput callback), "no_logging_step" (it was on, but the
        # run ended before its first logging step: trainer.log_every_n_steps), or "logged".
        "throughput": ("logged" if summary.get("train/tokens_per_sec") is not None else "no_logging_step")
        if throughput_on
        else "off",
        "log_every_n_steps": trainer.log_every_n_steps,
        "metrics": {
            k: v for k, v in summary.items() if "/" in k
        },  # the telemetry callbacks' last values, by metric name
        # The planner's prediction for this run's layout beside what it measured (and what calibration refits from).
        "planner": planned,
        "curves": {"train/loss": record.train_curve, "val/loss": record.val_curve},
    }


def environment(trainer: Trainer) -> dict[str, Any]:
    """What a run ran on: package versions, the git commit of the working directory, the hardware."""
    import platform
    import subprocess
    from importlib import metadata

    versions = {}
    for package in ("lightning-scale", "torch", "lightning", "hydra-core", "wandb", "transformers", "deepspeed"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    device = trainer.strategy.root_device
    return {
        "versions": {"python": platform.python_version(), **versions},
        "git_commit": commit,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "threads_per_process": torch.get_num_threads(),
        "accelerator": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
    }


def log_config(trainer: Trainer, cfg: DictConfig) -> None:
    """The full resolved config and the environment into the wandb run, at the start, from global
    rank 0 (the only rank with a run; the environment costs a ``git`` call)."""
    loggers = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
    if not loggers or not trainer.is_global_zero:
        return
    # Not "config": a LightningModule's saved hyper-parameters often hold a key of that name.
    params = {"resolved_config": OmegaConf.to_container(cfg, resolve=True), "environment": environment(trainer)}
    for logger in loggers:
        logger.log_hyperparams(params)
