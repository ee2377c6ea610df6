"""``lightning-scale-plan calibrate DIR [DIR ...]``: fit the planner's efficiency factors to measured runs.

Every ``results.json`` under the directories (a sweep's ``multirun/<study>``, a run's ``outputs/...``)
that completed, measured its throughput and carries the planner's record of its inputs
(``planner.inputs``: every run of ``HybridParallelStrategy`` through ``lightning-scale-train``) is one
observation. Per system (device and links), :func:`~lightning_scale.core.planner.calibration.fit_efficiency`
fits the factors (``--fit``; default compute, overhead and intra_link, or on a CPU host compute, overhead
and framework_collectives) and stores them
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


def observations_in(dirs: Sequence[Path]) -> tuple[dict[str, tuple[Cluster, list[Observation]]], list[str]]:
    """The observations under ``dirs`` grouped by system key, and why each other ``results.json`` was left out."""
    groups: dict[str, tuple[Cluster, list[Observation]]] = {}
    skipped: list[str] = []
    for root in dirs:
        if not root.is_dir():
            raise ValueError(f"{root} is not a directory; pass sweep or run directories holding results.json files.")
        for path in sorted(root.rglob("results.json")):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError) as err:
                skipped.append(f"{path}: not readable JSON ({err})")
                continue
            record = doc.get("planner") if isinstance(doc, dict) else None
            if not isinstance(record, dict) or "inputs" not in record:
                why = (
                    record.get("error")
                    if isinstance(record, dict)
                    else "no planner record (another strategy, or an older run)"
                )
                skipped.append(f"{path}: {why}")
                continue
            measured = record.get("measured") or {}
            step = measured.get("step_time_s") if isinstance(measured, dict) else None
            if doc.get("status") != "completed" or not step:
                skipped.append(f"{path}: no measured step time (status {doc.get('status')!r}; throughput logged?)")
                continue
            where = str(path)
            system = cluster_from_record(record["inputs"].get("cluster"), where)
            name = f"{path.parent.name}:{record.get('layout', '?')}"
            observation = observation_from_record(record["inputs"], step, where, name)
            key = record["inputs"]["cluster"]["key"]
            groups.setdefault(key, (system, []))[1].append(observation)
    return groups, skipped


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
        factors = default_fit(system) if fit is None else tuple(fit)
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
    parser.add_argument("dirs", nargs="+", type=Path, help="sweep or run directories holding results.json files")
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
