"""A study's end: the winner (``winner.yaml``: the overrides that run it, and its strategy as resolved),
what the study cost against what the full grid would have, and one plot (``study.png``): for a layout
study, the planner's tokens/s before and after calibration against the measured, per layout; for a
hyper-parameter study, each trial's metric; pruned trials greyed with their last figures.

Imports from ``cli`` only ``results`` and ``study_state`` (see ``cli/__init__.py``).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lightning_scale.cli.results import write_json
from lightning_scale.cli.study_state import StudyOptions

__all__ = ["write_report"]


def _cost(device_s: float, price: float | None) -> dict[str, Any]:
    hours = device_s / 3600
    return {"device_s": round(device_s, 1), "device_hours": hours, "usd": None if price is None else hours * price}


def write_report(
    study_dir: Path,
    doc: Mapping[str, Any],
    options: StudyOptions,
    predicted: Mapping[str, Mapping[str, Any]],
    price: float | None,
) -> dict[str, Any]:
    """Write ``study_report.json``, ``winner.yaml`` and ``study.png`` under ``study_dir``; the report."""
    trials = doc["trials"]
    completed = {n: t for n, t in trials.items() if t["status"] == "completed" and t.get("value") is not None}
    pruned = {n: t for n, t in trials.items() if t["status"] == "pruned"}
    winner = None
    if completed:
        pick = max if options.maximise else min
        winner = pick(completed, key=lambda n: float(completed[n]["value"]))
    spent = sum(float(t.get("device_s", 0.0)) for t in trials.values())
    full = [float(t["device_s"]) for t in completed.values()]
    grid_size = len(predicted) if options.kind == "layouts" else len(trials)
    grid_s = statistics.mean(full) * grid_size if full else None
    report: dict[str, Any] = {
        "kind": options.kind,
        "metric": options.metric,
        "pruner": options.pruner,
        "winner": winner,
        "winner_value": completed[winner]["value"] if winner else None,
        "winner_overrides": trials[winner]["overrides"] if winner else None,
        "cost": _cost(spent, price),
        "grid": {"trials": grid_size, **(_cost(grid_s, price) if grid_s is not None else {})},
        "cost_vs_grid": spent / grid_s if grid_s else None,
        "trials": {
            n: {k: t.get(k) for k in ("status", "value", "rungs", "pruned_at", "reason", "device_s", "layout")}
            for n, t in trials.items()
        },
        "predicted_before": doc.get("predicted_before", {}),
        "predicted_after": doc.get("predicted_after", {}),
        "rounds": doc.get("rounds", []),
    }
    lines = [
        f"study {study_dir.name}: {len(completed)} completed, {len(pruned)} pruned, "
        f"{sum(t['status'] in ('failed', 'skipped') for t in trials.values())} failed or skipped of {grid_size}",
        f"cost: {spent:.0f} device-s ({spent / 3600:.4f} device-hours"
        + (f", ${spent / 3600 * price:.4f}" if price else "")
        + ")"
        + (f"; the full grid: about {grid_s:.0f} device-s ({spent / grid_s:.0%} of it)" if grid_s else ""),
    ]
    for n, t in trials.items():
        if t["status"] == "pruned":
            lines.append(f"  {n}: pruned at step {t.get('pruned_at')}: {t.get('reason')}")
    if winner:
        lines.append(
            f"winner: {winner} ({options.metric} {completed[winner]['value']}); config: {study_dir / 'winner.yaml'}"
        )
        _winner_yaml(study_dir, doc, winner)
    else:
        lines.append("no trial completed: no winner")
    report["summary"] = "\n".join(lines)
    write_json(study_dir / "study_report.json", report)
    _plot(study_dir / "study.png", report, options)
    return report


def _winner_yaml(study_dir: Path, doc: Mapping[str, Any], winner: str) -> None:
    trial = doc["trials"][winner]
    overrides = [*doc.get("fixed_overrides", []), *trial["overrides"]]
    resolved = Path(trial.get("run_dir", "")) / "resolved_config.yaml"
    strategy = OmegaConf.to_container(OmegaConf.load(resolved).strategy) if resolved.is_file() else None
    text = OmegaConf.to_yaml(
        {
            "trial": winner,
            "overrides": overrides,
            "command": "lightning-scale-train " + " ".join(overrides),
            "strategy": strategy,
        }
    )
    (study_dir / "winner.yaml").write_text(text)


def _plot(path: Path, report: Mapping[str, Any], options: StudyOptions) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    trials = report["trials"]
    if options.kind == "layouts":
        before, after = report["predicted_before"], report["predicted_after"]
        for name, t in trials.items():
            measured = t["value"] if t["status"] == "completed" else next(iter((t.get("rungs") or {}).values()), None)
            if measured is None:
                continue
            grey = t["status"] != "completed"
            if name in before:
                ax.scatter(measured, before[name], marker="o", facecolors="none", edgecolors="grey" if grey else "C0")
            if name in after:
                ax.scatter(measured, after[name], marker="x", color="lightgrey" if grey else "C1")
            ax.annotate(
                name + (" (pruned)" if grey else ""),
                (measured, after.get(name, before.get(name, measured))),
                fontsize=6,
            )
        lo, hi = ax.get_xlim()
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.5)
        ax.set_xlabel("measured tokens/s")
        ax.set_ylabel("predicted tokens/s (o before, x after calibration)")
    else:
        names = list(trials)
        values = [
            t["value"]
            if t["status"] == "completed"
            else next(reversed(list((t.get("rungs") or {0: float("nan")}).values())))
            for t in trials.values()
        ]
        colors = ["C0" if t["status"] == "completed" else "lightgrey" for t in trials.values()]
        ax.barh(range(len(names)), values, color=colors)
        ax.set_yticks(
            range(len(names)), [n + (" (pruned)" if trials[n]["status"] == "pruned" else "") for n in names], fontsize=6
        )
        ax.set_xlabel(str(options.metric))
    ax.set_title(f"study: winner {report.get('winner')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
