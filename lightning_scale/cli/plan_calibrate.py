"""``lightning-scale-plan calibrate PATH [PATH ...]``: fit the planner's efficiency factors to measured runs.

Every ``results.json`` under the directories (a sweep's ``multirun/<study>``, a run's ``outputs/...``), and
every run of a ``benchmarks/gpu_check.py`` JSON (``gpu_check-<device>-<date>.json``, given as a file or found
under a directory), that completed, measured its throughput and carries the planner's record of its inputs
(``planner.inputs``: every run of ``HybridParallelStrategy`` through ``lightning-scale-train``) is one
observation. Per system (device and links), :func:`~lightning_scale.core.planner.calibration.fit_efficiency`
fits the factors (``--fit``; default compute, overhead and intra_link, or on a CPU host compute, overhead
and framework_collectives; with ``float8_gemm`` too when a run trained float8 linears, gpu_check's fp8 run, so
plans take the measured float8 speed-up) and stores them
(``--store``, default ``$LIGHTNING_SCALE_CALIBRATION`` or ``~/.cache/lightning_scale/calibration.json``);
later plans on that system (``lightning-scale-plan``, ``strategy=auto``) use them and print their source.
Each run's measured step time is printed with the prediction before and after.

The files are read as JSON and each field checked (:mod:`lightning_scale.core.planner.calibration`);
nothing in them is run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_scale.core.planner.calibration import (
    CPU_FITTED,
    FITTED,
    Observation,
    calibration_path,
    cluster_from_record,
    default_fit,
    fit_efficiency,
    observation_from_record,
    save_calibration,
)
from lightning_scale.core.planner.cluster import Cluster
from lightning_scale.core.planner.step_time import estimate_time

__all__ = ["calibrate", "main", "observations_in"]


def _documents(roots: Sequence[Path]) -> list[tuple[Path, Any]]:
    """Each file to read: a ``results.json`` or ``gpu_check-*.json`` under a directory, or a file given itself."""
    paths: list[Path] = []
    for root in roots:
        if root.is_file():
            paths.append(root)
        elif root.is_dir():
            paths += sorted({*root.rglob("results.json"), *root.rglob("gpu_check-*.json")})
        else:
            raise ValueError(
                f"{root} is neither a directory nor a file; pass sweep or run directories holding results.json "
                "files, or a benchmarks/gpu_check.py JSON."
            )
    docs: list[tuple[Path, Any]] = []
    for path in paths:
        try:
            docs.append((path, json.loads(path.read_text())))
        except (OSError, ValueError) as err:
            docs.append((path, ValueError(f"not readable JSON ({err})")))
    return docs


def observations_in(dirs: Sequence[Path]) -> tuple[dict[str, tuple[Cluster, list[Observation]]], list[str]]:
    """The observations under ``dirs`` (directories, or files given themselves) grouped by system key, and why
    each other run was left out. A run is a ``results.json`` (``lightning-scale-train``) or one of the ``runs``
    of a ``benchmarks/gpu_check.py`` JSON (``gpu_check-<device>-<date>.json``): both carry ``status`` and the
    planner's record (``planner``: ``inputs``, ``measured``, ``layout``)."""
    groups: dict[str, tuple[Cluster, list[Observation]]] = {}
    skipped: list[str] = []
    for path, doc in _documents(dirs):
        if isinstance(doc, ValueError):
            skipped.append(f"{path}: {doc}")
            continue
        runs = doc.get("runs") if isinstance(doc, dict) and isinstance(doc.get("runs"), list) else None
        if runs is None:
            named = [(str(path), path.parent.name, doc)]
        else:  # a gpu_check JSON: one observation per run
            named = [
                (
                    f"{path}#runs[{i}]",
                    f"{r.get('preset', i)}-{r.get('compile', '')}{'-fp8' if r.get('float8') else ''}",
                    r,
                )
                if isinstance(r, dict)
                else (f"{path}#runs[{i}]", str(i), r)
                for i, r in enumerate(runs)
            ]
        for where, label, run in named:
            if isinstance(run, dict) and run.get("calibrate") is False:
                # gpu_check's eager twin of a compiled run: the planner's record does not tell them apart
                skipped.append(f"{where}: measured for comparison only (calibrate: false)")
                continue
            problem = _observe(run, where, label, groups)
            if problem:
                skipped.append(f"{where}: {problem}")
    return groups, skipped


def _observe(doc: Any, where: str, label: str, groups: dict[str, tuple[Cluster, list[Observation]]]) -> str:
    """Add ``doc``'s observation to ``groups``; or why it has none."""
    record = doc.get("planner") if isinstance(doc, dict) else None
    if not isinstance(record, dict) or not record.get("inputs"):
        if isinstance(record, dict) and (record.get("error") or record.get("problem")):
            return str(record.get("error") or record.get("problem"))
        return "no planner record (another strategy, or an older run)"
    measured = record.get("measured") or {}
    step = measured.get("step_time_s") if isinstance(measured, dict) else None
    if doc.get("status") != "completed" or not step:
        return f"no measured step time (status {doc.get('status')!r}; throughput logged?)"
    system = cluster_from_record(record["inputs"].get("cluster"), where)
    observation = observation_from_record(record["inputs"], step, where, f"{label}:{record.get('layout', '?')}")
    key = record["inputs"]["cluster"]["key"]
    groups.setdefault(key, (system, []))[1].append(observation)
    return ""


def calibrate(dirs: Sequence[Path], *, fit: Sequence[str] | None = None, store: Path | None = None) -> list[str]:
    """Fit and store each system's factors (``fit``, else each system's default); the lines to print."""
    groups, skipped = observations_in(dirs)
    if not groups:
        raise ValueError(
            f"No run under {', '.join(map(str, dirs))} has a planner record and a measured step time"
            + (f" ({len(skipped)} results.json left out: {skipped[0]})" if skipped else " (no results.json found)")
            + ". Calibrate from runs of lightning-scale-train with strategy=hybrid (or auto) and the throughput callback."
        )
    lines = [f"left out: {s}" for s in skipped]
    for key, (system, observations) in groups.items():
        factors = default_fit(system, observations) if fit is None else tuple(fit)  # fp8 runs: float8_gemm too
        fitted = fit_efficiency(observations, system, fit=factors)
        path = save_calibration(system, fitted, observations, store)
        lines.append(f"{key}: {len(observations)} run(s); {fitted.source}; stored in {path}")
        lines.append(f"  {'run':40s} {'measured s':>11s} {'before s':>10s} {'after s':>10s} {'error':>8s}")
        for o in observations:
            before = estimate_time(o.shape, o.workload, o.candidate, system, peak=o.peak).step_time
            after = estimate_time(o.shape, o.workload, o.candidate, system, fitted, peak=o.peak).step_time
            lines.append(
                f"  {o.name:40s} {o.step_time:11.4f} {before:10.4f} {after:10.4f} {after / o.step_time - 1:+8.1%}"
            )
        lines.append("  fitted: " + ", ".join(f"{f}={getattr(fitted, f):.4g}" for f in factors))
        if len(observations) < len(factors):
            lines.append(
                f"  note: {len(observations)} run(s) for {len(factors)} factors: the fit is not unique; add runs "
                "that differ in layout."
            )
    return lines


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-scale-plan calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "dirs",
        nargs="+",
        type=Path,
        help="sweep or run directories holding results.json files, or benchmarks/gpu_check.py JSON files",
    )
    parser.add_argument(
        "--fit",
        default=None,
        help=f"factors to fit, comma-separated (default {','.join(FITTED)}; on a CPU host {','.join(CPU_FITTED)})",
    )
    parser.add_argument("--store", type=Path, default=None, help=f"the calibration file (default {calibration_path()})")
    args = parser.parse_args(argv)
    try:
        fit = None if args.fit is None else [f for f in args.fit.split(",") if f]
        for line in calibrate(args.dirs, fit=fit, store=args.store):
            print(line)
    except ValueError as err:
        print(f"lightning-scale-plan calibrate: error: {err}", file=sys.stderr)
        return 2
    return 0
