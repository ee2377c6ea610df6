"""The report's plots: what each configuration of a sweep delivered, and whether to trust it.

- **Groups.** Jobs that share a configuration are one group: they differ only in a repeat key
  (``seed``, ``repeat``, ``trial``, e.g. ``repeat=range(3)``), or are the same configuration in two
  studies reported together. A group's label is what varies between groups (``tp=2 pp=1``,
  ``devices=4``, ``bf16-mixed``); its bar is the median of its jobs, its error bar their min..max.
- **Bars** (throughput, USD per 1M tokens, MFU, peak memory): one horizontal bar per group, best
  first (at the top), each with its value written beside it.
- **Scaling** (tokens/s against devices with the ideal line, scaling efficiency): only when the
  groups span more than one device count; the measured point at a device count is its best group.
- **Planner.** :func:`planner_table`: each job's predicted step time and tokens/s beside the measured ones.
- **Noise.** Throughput is flagged when the repeats of one configuration differ by more than
  ``NOISE_SPREAD`` of their median ((max - min) / median), or when a job started on a busy machine:
  a 1-minute load average of at least ``LOADED_AT`` before its processes started (``load_average``
  in ``results.json``, ``{"start": ..., "end": ...}`` from ``os.getloadavg()[0]``).

Every PNG says what it shows in text chunks: ``Title``; ``Series`` (the name and colour of each
series drawn); for bar charts ``Bars`` (label, median, min, max and runs of each bar, top to bottom).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "LOADED_AT",
    "NOISE_SPREAD",
    "PALETTE",
    "REPEAT_KEYS",
    "Group",
    "Plotter",
    "group_jobs",
    "no_throughput_note",
    "noise",
    "planner_table",
    "plot_all",
]

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
"""Series colours, in order; each PNG lists its series and their colours in its ``Series`` text chunk."""

REPEAT_KEYS = frozenset({"seed", "repeat", "trial"})
"""Override keys (their last dotted part) that repeat a configuration rather than change it."""

NOISE_SPREAD = 0.05
"""Repeats whose tokens/s differ by more than this fraction of their median make the report warn."""

LOADED_AT = 1.0
"""A 1-minute load average at job start of at least this (one core's worth of other work) is a busy machine."""

# Override keys the label already shows through the job's own record (devices, layout, precision, batch).
_COVERED = (
    "data_parallel",
    "tensor_parallel",
    "pipeline_parallel",
    "data_parallel_mode",
    "trainer.devices",
    "trainer.num_nodes",
    "precision",
    "global_batch_size",
)
_LAYOUT_FIELDS = {"devices", "nodes", "mode", "tp", "pp", "layout"}
_BARE = {"precision", "mode"}  # shown as the value alone: "bf16-mixed", not "precision=bf16-mixed"
_ERROR_BAR = "#222222"


def _override_items(job: Mapping[str, Any]) -> list[tuple[str, str]]:
    items = []
    for item in job.get("overrides") or []:
        key, _, value = str(item).partition("=")
        items.append((key.lstrip("+~"), value))
    return items


def _fields(job: Mapping[str, Any]) -> dict[str, str]:
    """What defines a job's configuration, in label order (dp is left out: it is devices / (tp x pp))."""
    sizes = job.get("layout_sizes") or {}
    fields = {"devices": str(job.get("world_size", "?")), "nodes": str(job.get("num_nodes", 1))}
    if sizes:
        fields |= {"mode": str(sizes.get("mode", "")), "tp": str(sizes.get("tp", "?")), "pp": str(sizes.get("pp", "?"))}
    else:
        fields["layout"] = str(job.get("layout") or "?")
    fields |= {"precision": str(job.get("precision", "")), "batch": str(job.get("global_batch_size", ""))}
    for key, value in _override_items(job):
        if key in ("strategy", "study") or key.startswith("hydra.") or key.endswith(_COVERED):
            continue
        if key.rsplit(".", 1)[-1] not in REPEAT_KEYS:
            fields[key.rsplit(".", 1)[-1]] = value
    return fields


@dataclass
class Group:
    """The jobs of one configuration and the label that tells it from the other groups."""

    fields: dict[str, str]
    jobs: list[dict[str, Any]] = field(default_factory=list)
    label: str = ""

    def values(self, key: str) -> list[float]:
        return [float(j[key]) for j in self.jobs if j.get(key) is not None]

    @property
    def world_size(self) -> int | None:
        worlds = {j.get("world_size") for j in self.jobs}
        world = worlds.pop() if len(worlds) == 1 else None
        return int(world) if world else None


def group_jobs(jobs: Sequence[dict[str, Any]]) -> list[Group]:
    """The jobs grouped by configuration, in order of first appearance, each group labelled."""
    groups: dict[tuple[tuple[str, str], ...], Group] = {}
    for job in jobs:
        fields = _fields(job)
        groups.setdefault(tuple(sorted(fields.items())), Group(fields)).jobs.append(job)
    found = list(groups.values())
    keys = list(dict.fromkeys(k for g in found for k in g.fields))
    varied = [k for k in keys if len({g.fields.get(k) for g in found}) > 1]
    for g in found:
        parts = [g.fields[k] if k in _BARE else f"{k}={g.fields[k]}" for k in varied if k in g.fields]
        g.label = " ".join(parts) or str(g.jobs[0].get("layout") or "?")
    if len({g.label for g in found}) < len(found):  # fields that vary only in their absence: add the layout
        for g in found:
            g.label = f"{g.jobs[0].get('layout') or '?'} {g.label}".strip()
    return found


def _what(groups: Sequence[Group]) -> str:
    varied = {k for k in groups[0].fields if len({g.fields.get(k) for g in groups}) > 1} if groups else set()
    return "layout" if varied <= _LAYOUT_FIELDS else "configuration"


def _spread(values: Sequence[float]) -> float:
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else 0.0


def load_at_start(job: Mapping[str, Any]) -> float | None:
    """The 1-minute load average before the job's processes started, where ``results.json`` has it
    (``load_average: {"start": ..., "end": ...}``, at the top or under ``environment``)."""
    for doc in (job, job.get("environment") or {}):
        load = doc.get("load_average")
        if isinstance(load, Mapping):
            load = load.get("start")
        if isinstance(load, (int, float)) and not isinstance(load, bool):
            return float(load)
    return None


def noise(groups: Sequence[Group], job_label: Mapping[int, str]) -> tuple[list[str], list[str]]:
    """(warnings, notes) on how far the throughput can be trusted: repeats that disagree by more than
    ``NOISE_SPREAD``, jobs that started on a busy machine; notes when there is nothing to tell by."""
    warnings, notes = [], []
    rule = f"(max - min) / median over {NOISE_SPREAD:.0%}"
    for g in groups:
        rates = g.values("tokens_per_sec")
        if len(rates) > 1 and _spread(rates) > NOISE_SPREAD:
            warnings.append(
                f"{g.label}: its {len(rates)} runs differ by {_spread(rates):.0%} in tokens/s "
                f"({min(rates):,.0f} to {max(rates):,.0f}; {rule})."
            )
    jobs = [j for g in groups for j in g.jobs]
    loads = {id(j): load_at_start(j) for j in jobs}
    busy = [j for j in jobs if (loads[id(j)] or 0.0) >= LOADED_AT]
    if busy:
        listed = ", ".join(f"{job_label[id(j)]} ({loads[id(j)]:.1f} on {j.get('cpu_count') or '?'} CPUs)" for j in busy)
        warnings.append(
            f"{len(busy)} of {len(jobs)} jobs started on a busy machine (1-minute load average >= {LOADED_AT:g}): {listed}."
        )
    if warnings:
        warnings.insert(
            0,
            "Throughput is noisy: a difference smaller than the spread below decides nothing. Rerun on an idle "
            "machine, with repeats (e.g. repeat=range(3)), before choosing a layout by it.",
        )
    if not any(len(g.values("tokens_per_sec")) > 1 for g in groups):
        notes.append(
            "No configuration was repeated, so the spread of throughput is unknown: add repeats to the sweep, "
            f"e.g. repeat=range(3) (jobs that differ only in {' or '.join(sorted(REPEAT_KEYS))} are repeats of one "
            "configuration)."
        )
    if jobs and all(v is None for v in loads.values()):
        notes.append(
            "The jobs did not record the machine's load (load_average in results.json): a busy machine "
            "would make throughput noisy unnoticed."
        )
    return warnings, notes


def scaling(groups: Sequence[Group]) -> tuple[list[int], list[float], list[float]] | None:
    """(device counts, best group's median tokens/s at each, ideal tokens/s at each), or ``None``
    when the groups do not span two device counts."""
    best: dict[int, float] = {}
    for g in groups:
        rates, world = g.values("tokens_per_sec"), g.world_size
        if rates and world:
            best[world] = max(best.get(world, 0.0), statistics.median(rates))
    if len(best) < 2:
        return None
    devices = sorted(best)
    base = devices[0]
    return devices, [best[d] for d in devices], [best[base] * d / base for d in devices]


def efficiency_base(groups: Sequence[Group]) -> float | None:
    """Tokens/s per device at the smallest device count (its best group), when devices vary."""
    found = scaling(groups)
    return None if found is None else found[1][0] / found[0][0]


def _text(value: float, unit: str) -> str:
    if unit == "%":
        return f"{value:.1f}%"
    text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return f"{text} {unit}" if unit else text


class Plotter:
    """Draws and saves the report's PNGs into ``directory``; ``plots`` maps name to path, in order."""

    def __init__(self, directory: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt = plt
        self.directory = directory
        self.plots: dict[str, Path] = {}

    def save(self, fig: Any, name: str, title: str, series: list[tuple[str, str]], **chunks: Any) -> None:
        path = self.directory / f"{name}.png"
        meta = {
            "Title": title,
            "Series": json.dumps([{"name": n, "color": c} for n, c in series]),
            "Software": "lightning-scale",
        }
        meta |= {k: json.dumps(v) for k, v in chunks.items()}
        fig.tight_layout()
        fig.savefig(path, dpi=100, metadata=meta, bbox_inches="tight", pad_inches=0.15)  # nothing clipped
        self.plt.close(fig)
        self.plots[name] = path

    def bars(
        self, name: str, title: str, rows: list[tuple[str, list[float]]], xlabel: str, series: str, unit: str
    ) -> None:
        """One horizontal bar per (label, values) in the given order, top down: the median, an error
        bar from min to max where there are repeats, and the value (and runs) beside it."""
        mids = [statistics.median(v) for _, v in rows]
        lows, highs = [min(v) for _, v in rows], [max(v) for _, v in rows]
        repeated = any(len(v) > 1 for _, v in rows)
        fig, ax = self.plt.subplots(figsize=(7.0, max(2.6, 1.3 + 0.45 * len(rows))))
        y = list(range(len(rows)))
        ax.barh(y, mids, height=0.6, color=PALETTE[0], label="median of repeats" if repeated else series)
        if repeated:
            err = [
                [m - lo for m, lo in zip(mids, lows, strict=True)],
                [hi - m for m, hi in zip(mids, highs, strict=True)],
            ]
            ax.errorbar(
                mids, y, xerr=err, fmt="none", ecolor=_ERROR_BAR, elinewidth=1.5, capsize=4, label="min..max of repeats"
            )
        top = max(highs) if highs else 1.0
        for i, (_, values) in enumerate(rows):
            text = _text(mids[i], unit) + (f"  (median of {len(values)})" if len(values) > 1 else "")
            ax.text(highs[i] + 0.02 * top, i, text, va="center", ha="left", fontsize=8)
        ax.set_yticks(y, [label for label, _ in rows], fontsize=9)
        ax.invert_yaxis()  # the best at the top
        ax.set_xlim(0, top * 1.45 if top > 0 else 1.0)
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
        if repeated:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        bars = [
            {"label": label, "value": m, "min": lo, "max": hi, "runs": len(v)}
            for (label, v), m, lo, hi in zip(rows, mids, lows, highs, strict=True)
        ]
        self.save(fig, name, title, [(series, PALETTE[0])], Bars=bars)


def _scaling_plots(
    plotter: Plotter, groups: Sequence[Group], found: tuple[list[int], list[float], list[float]]
) -> None:
    plt = plotter.plt
    devices, measured, ideal = found
    outside = {"loc": "upper left", "bbox_to_anchor": (1.02, 1.0), "frameon": False}
    fig, ax = plt.subplots(figsize=(6.5, 4))
    points = [
        (j["world_size"], j["tokens_per_sec"]) for g in groups for j in g.jobs if j.get("tokens_per_sec") is not None
    ]
    ax.plot(devices, ideal, "--s", color=PALETTE[9], linewidth=2, markersize=7, label="ideal")
    ax.plot(devices, measured, "-o", color=PALETTE[0], linewidth=2.5, label="measured (best)")
    ax.scatter([p[0] for p in points], [p[1] for p in points], color=PALETTE[0], s=18, zorder=3, label="each job")
    for d, m in zip(devices, measured, strict=True):
        ax.annotate(
            f"{m:,.0f}", (d, m), textcoords="offset points", xytext=(6, -12), ha="left", fontsize=8
        )  # under the ideal
    ax.set_xlabel("devices")
    ax.set_ylabel("tokens/s")
    ax.set_xticks(devices)
    ax.set_ylim(0, max(ideal + measured) * 1.15)
    ax.set_title("Throughput against devices")
    ax.legend(**outside)
    ax.grid(alpha=0.3)
    plotter.save(
        fig, "throughput_vs_devices", "Throughput against devices", [("measured", PALETTE[0]), ("ideal", PALETTE[9])]
    )
    fig, ax = plt.subplots(figsize=(6.5, 4))
    efficiency = [m / i for m, i in zip(measured, ideal, strict=True)]
    ax.axhline(1.0, linestyle="--", color=PALETTE[9], linewidth=2, label="ideal")
    ax.plot(devices, efficiency, "-o", color=PALETTE[2], linewidth=2.5, label="efficiency")
    for d, e in zip(devices, efficiency, strict=True):
        ax.annotate(f"{e:.0%}", (d, e), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    ax.set_xlabel("devices")
    ax.set_ylabel("measured / ideal throughput")
    ax.set_xticks(devices)
    ax.set_ylim(0, max(1.1, max(efficiency) * 1.1))
    ax.set_title("Scaling efficiency")
    ax.legend(**outside)
    ax.grid(alpha=0.3)
    plotter.save(fig, "scaling_efficiency", "Scaling efficiency", [("efficiency", PALETTE[2]), ("ideal", PALETTE[9])])


def no_throughput_note(jobs: Sequence[dict[str, Any]]) -> str:
    """Why no job recorded tokens/s: the callback was off, or on but the runs ended before it logged."""
    states = {j.get("throughput") for j in jobs}
    if "no_logging_step" in states:
        every = sorted({int(j["log_every_n_steps"]) for j in jobs if j.get("log_every_n_steps")})
        steps = sorted({int(j["global_step"]) for j in jobs if j.get("global_step") is not None})
        return (
            "No job logged throughput (train/tokens_per_sec): the throughput callback was on, but no job reached a "
            f"logging step (trainer.log_every_n_steps={','.join(map(str, every)) or '?'}; the jobs ran "
            f"{','.join(map(str, steps)) or '?'} steps). Train longer or log more often."
        )
    if states <= {"off"}:
        return "No job logged throughput (train/tokens_per_sec): the throughput callback was off."
    return "No job logged throughput (train/tokens_per_sec): the throughput callback was off, or no job reached a logging step."


def plot_all(
    plotter: Plotter, jobs: Sequence[dict[str, Any]], job_label: Mapping[int, str], metrics: Mapping[str, Any]
) -> list[str]:
    """Draw every plot the completed ``jobs`` allow (``metrics``: the report's ``METRICS``); returns
    notes on those it could not draw."""
    groups = group_jobs(jobs)
    notes, what = [], _what(groups)
    for key, name, title in (
        ("tokens_per_sec", "throughput_by_layout", f"Throughput by {what}"),
        ("usd_per_1m_tokens", "usd_per_1m_tokens_by_layout", f"USD per 1M tokens by {what}"),
        ("mfu", "mfu_by_layout", f"MFU by {what}"),
        ("peak_memory_bytes", "memory_per_device", "Peak memory per device"),
    ):
        m = metrics[key]
        factor, unit = (100.0, "%") if key == "mfu" else (m.scale, m.unit)
        rows = [(g.label, [v * factor for v in g.values(key)]) for g in groups]
        rows = [r for r in rows if r[1]]
        if not rows:
            notes.append(
                no_throughput_note(jobs) if key == "tokens_per_sec" else f"No job recorded {key}: {title} is not drawn."
            )
            continue
        rows.sort(key=lambda r: statistics.median(r[1]), reverse=m.higher_is_better)
        better = "higher" if m.higher_is_better else "lower"
        xlabel = f"{m.label}" + (f" ({unit})" if unit else "") + f", {better} is better"
        plotter.bars(name, f"{title}, best first", rows, xlabel, key, unit)
    found = scaling(groups)
    if found is not None:
        _scaling_plots(plotter, groups, found)
    elif any(g.values("tokens_per_sec") for g in groups):
        notes.append("One device count: no throughput-against-devices or scaling-efficiency plot.")
    curves = [
        (j, (j.get("curves") or {}).get("train/loss") or [], (j.get("curves") or {}).get("val/loss") or [])
        for j in jobs
    ]
    curves = [c for c in curves if c[1] or c[2]]
    if not curves:
        notes.append("No loss curves were recorded.")
        return notes
    fig, ax = plotter.plt.subplots(figsize=(8.0, 4.2))
    series = []
    for i, (job, train, val) in enumerate(curves):
        color = PALETTE[i % len(PALETTE)]
        label = job_label[id(job)]
        if train:
            ax.plot([s for s, _ in train], [v for _, v in train], "-", color=color, linewidth=2, label=f"{label} train")
        if val:
            ax.plot(
                [s for s, _ in val],
                [v for _, v in val],
                "--o",
                color=color,
                linewidth=2,
                markersize=3,
                label=f"{label} val",
            )
        series.append((label, color))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss curves")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    plotter.save(fig, "loss_curves", "Loss curves", series)
    return notes


def planner_table(
    jobs: Sequence[dict[str, Any]], labels: dict[int, str]
) -> tuple[list[str], list[list[str]], str] | None:
    """The planner's prediction for each job's layout beside what the job measured (``results.json``'s
    ``planner``) with the error, and a note (the efficiency used, the mean error); None when no job has one."""
    rows = [j for j in jobs if isinstance(j.get("planner"), dict) and "predicted" in j["planner"]]
    if not rows:
        return None
    header = [
        "job",
        "layout",
        "chosen by",
        "predicted step s",
        "measured step s",
        "error",
        "predicted tokens/s",
        "measured tokens/s",
    ]
    body, errors = [], []
    for j in rows:
        p = j["planner"]
        error, measured = (p.get("error") or {}).get("step_time_s"), (p.get("measured") or {}).get("step_time_s")
        errors += [abs(error)] if error is not None else []
        rate = j.get("tokens_per_sec")
        body.append(
            [
                labels[id(j)],
                str(p.get("layout")),
                str(p.get("chosen_by")),
                f"{p['predicted']['step_time_s']:.4g}",
                "–" if measured is None else f"{measured:.4g}",
                "–" if error is None else f"{error:+.1%}",
                f"{p['predicted']['tokens_per_sec']:,.0f}",
                "–" if rate is None else f"{rate:,.0f}",
            ]
        )
    mean = (
        f" Mean absolute step-time error {sum(errors) / len(errors):.1%} over {len(errors)} job(s)." if errors else ""
    )
    return header, body, f"Efficiency: {rows[0]['planner'].get('efficiency', '')}.{mean}"
