"""A layout study's candidates and predictions: every layout of the training config's processes the
planner says fits (and ``study.space`` allows), as the strategy overrides that run it, with the planner's
step time before calibration; after some ran, every candidate predicted again with the factors fitted to
what they measured (:func:`~lightning_scale.core.planner.calibration.fit_efficiency`, on this study's runs
only: the user's stored calibration is left as it was).

Imports from ``cli``: ``job_config`` and ``plan_calibrate`` (see ``cli/__init__.py``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from lightning_scale.cli.job_config import LayoutNotAdmitted, devices_per_node, instantiate, preflight
from lightning_scale.cli.plan_calibrate import observations_in
from lightning_scale.core.planner import Candidate, Cluster, ModelShape, Workload, estimate, model_shape, plan
from lightning_scale.core.planner.calibration import Observation, calibrated, default_fit, fit_efficiency
from lightning_scale.core.planner.cluster import local_cluster
from lightning_scale.core.planner.step_time import estimate_time
from lightning_scale.core.telemetry.peaks import measured_peak
from lightning_scale.strategies.hybrid.planning import options_for

__all__ = ["calibrated_predictions", "candidates", "first_round", "predicted_step_time"]


def _inputs(cfg: DictConfig) -> tuple[ModelShape, Workload, Cluster, float | None]:
    shape = model_shape(instantiate(cfg.model))
    workload = Workload(int(cfg.data.global_batch_size), int(cfg.data.seq_len), str(cfg.precision.precision))
    per_node, nodes = devices_per_node(cfg), int(cfg.trainer.get("num_nodes", 1))
    if str(cfg.trainer.get("accelerator", "cpu")) in ("gpu", "cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        system = local_cluster(
            "cuda", devices_per_node=per_node, nodes=nodes, device_name=props.name, device_memory=props.total_memory
        )
        return shape, workload, calibrated(system), None
    # A CPU process's matmul rate at the threads each of the job's processes will have.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    try:
        peak = measured_peak(workload.compute_dtype)
    finally:
        torch.set_num_threads(threads)
    system = local_cluster("cpu", devices_per_node=per_node, nodes=nodes, peak_flops={workload.compute_dtype: peak})
    return shape, workload, calibrated(system), peak


def _overrides(candidate: Candidate, workload: Workload) -> dict[str, Any]:
    options = options_for(candidate, workload)
    if candidate.tp > 1:
        options["sequence_parallel"] = candidate.sequence_parallel
    if candidate.dp_mode == "hsdp":
        options["hsdp_shard"] = candidate.hsdp_shard
    return options


def _value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def candidates(cfg: DictConfig, space: Mapping[str, list[Any]]) -> dict[str, dict[str, Any]]:
    """Name -> ``{"overrides", "candidate", "step_time", "tokens_per_sec"}`` of every layout that fits, is
    trainable, is in ``space`` and that the model admits, the planner's fastest first (one per set of
    strategy options). ``ValueError`` for a key of ``space`` that is no strategy option the planner sets."""
    shape, workload, system, peak = _inputs(cfg)
    ranked = plan(shape, workload, system, headroom=0.1)
    known = set(_overrides(Candidate(dp=1, tp=2, pp=1, dp_mode="hsdp"), workload))
    unknown = sorted(set(space) - known)
    if unknown:
        raise ValueError(f"study.space has {unknown[0]!r}, which is no layout option; the options are {sorted(known)}.")
    seen: set[tuple[Any, ...]] = set()
    found: dict[str, dict[str, Any]] = {}
    for e in ranked:
        if not e.fits or not e.candidate.trainable:
            continue
        options = _overrides(e.candidate, workload)
        key = tuple(sorted(options.items()))
        if key in seen or any(options.get(k) not in allowed for k, allowed in space.items()):
            continue
        seen.add(key)
        # What the strategy runs with these options: without a pipeline, the whole local batch at once (the
        # planner's gradient-accumulation variants of a layout map to the same options).
        run = replace(
            e.candidate, micro_batch=workload.global_batch // e.candidate.dp // (options["microbatches"] or 1)
        )
        if run != e.candidate:
            e = estimate(shape, workload, run, system)
            if not e.fits:
                continue
        job = cfg.copy()
        for k, v in options.items():
            job.strategy[k] = v
        try:
            preflight(job)  # what the model admits (heads per tensor-parallel rank, a block per stage)
        except (LayoutNotAdmitted, ValueError):
            continue
        found[e.name] = {
            "overrides": [f"strategy.{k}={_value(v)}" for k, v in options.items()],
            "candidate": e.candidate,
            "step_time": e.time.step_time,
            "tokens_per_sec": e.tokens_per_sec,
            "sensitivity": _sensitivity(shape, workload, e.candidate, system, peak),
        }
    return dict(sorted(found.items(), key=lambda item: -item[1]["tokens_per_sec"]))


def _sensitivity(
    shape: ModelShape, workload: Workload, candidate: Candidate, system: Cluster, peak: float | None
) -> list[float]:
    """How the predicted step time of ``candidate`` moves with each factor calibration fits: d log(time) /
    d log(factor), or, for a factor at 0 (an additive cost such as ``overhead``), d log(time) per 1 ms of it."""
    base = estimate_time(shape, workload, candidate, system, peak=peak).step_time
    row = []
    for factor in default_fit(system):
        value = getattr(system.efficiency, factor)
        moved = replace(system.efficiency, **{factor: value * 1.1 if value > 0 else 1e-3})
        time = estimate_time(shape, workload, candidate, system, moved, peak=peak).step_time
        row.append(math.log(time / base) / (math.log(1.1) if value > 0 else 1.0))
    return row


def _log_det(rows: Sequence[Sequence[float]]) -> float:
    """log det(JᵀJ + 1e-6 I) of the rows' sensitivities J: how well runs of those layouts pin every factor
    (Gaussian elimination; the matrix is symmetric positive definite)."""
    k = len(rows[0])
    m = [[sum(r[i] * r[j] for r in rows) + (1e-6 if i == j else 0.0) for j in range(k)] for i in range(k)]
    total = 0.0
    for i in range(k):
        pivot = m[i][i]
        total += math.log(max(pivot, 1e-300))
        for r in range(i + 1, k):
            ratio = m[r][i] / pivot
            for c in range(i, k):
                m[r][c] -= ratio * m[i][c]
    return total


def first_round(found: Mapping[str, Mapping[str, Any]], k: int) -> list[str]:
    """The ``k`` layouts the study runs before it calibrates: the planner's fastest, then one at a time the
    layout that adds most to what the runs pin of every fitted factor per second it costs (a greedy,
    cost-weighted D-optimal design: the largest log det of the sensitivities' Gram matrix, less the log of the
    predicted step time). The top k alone tend to be alike (here: pipelines of one size), and a fit on them
    cannot tell how a tensor-parallel or many-micro-batch layout fares."""
    names = list(found)
    chosen = names[:1]
    while len(chosen) < min(k, len(names)):
        chosen.append(
            max(
                (n for n in names if n not in chosen),
                key=lambda n: (
                    _log_det([found[x]["sensitivity"] for x in [*chosen, n]]) - math.log(found[n]["step_time"])
                ),
            )
        )
    return chosen


def predicted_step_time(cfg: DictConfig) -> float:
    """The planner's step time for the config's own layout (as ``strategy.*`` sets it; 1 s when the planner
    cannot read it, e.g. another strategy)."""
    from lightning_scale.cli.job_config import layout_of

    shape, workload, system, _ = _inputs(cfg)
    layout = layout_of(cfg, None)
    strategy = cfg.get("strategy") or {}
    try:
        candidate = Candidate(
            dp=layout["dp"],
            tp=layout["tp"],
            pp=layout["pp"],
            dp_mode=layout["mode"] if layout["mode"] in ("ddp", "fsdp", "fsdp_grad_op", "hsdp") else "ddp",
            schedule=str(strategy.get("schedule", "1f1b")),
        )
        return estimate(shape, workload, candidate, system).time.step_time
    except (ValueError, KeyError, TypeError):
        return 1.0


def calibrated_predictions(
    trials: Path, found: Mapping[str, Mapping[str, Any]], partial: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Tokens/s of every candidate in ``found`` predicted with the factors fitted to the completed runs
    under ``trials`` and to ``partial`` (name -> tokens/s a pruned layout measured before it stopped, on the
    same system as the completed runs); empty when no run completed with a measured step time."""
    if not trials.is_dir():
        return {}
    groups, _ = observations_in([trials])
    if not groups:
        return {}
    system, observations = max(groups.values(), key=lambda g: len(g[1]))
    peak = observations[0].peak
    shape, workload = observations[0].shape, observations[0].workload
    for name, rate in (partial or {}).items():
        if name in found and rate > 0:
            observations.append(
                Observation(shape, workload, found[name]["candidate"], workload.tokens / rate, peak, f"{name} (pruned)")
            )
    fitted = fit_efficiency(observations, system, fit=default_fit(system))
    return {
        name: workload.tokens / estimate_time(shape, workload, c["candidate"], system, fitted, peak=peak).step_time
        for name, c in found.items()
    }
