"""The report's plots of a study that compares data-parallel synchronisation (the gradient all-reduce every step,
Local SGD, DiLoCo at several H; ``experiment=sync_sweep``): validation loss against tokens, against training time
and against bytes sent per process, one line per mode and H (``every_step``, ``diloco H=50``).

Drawn when the completed jobs differ in ``data_parallel_sync`` (or ``sync_every``), or any of them has a ``sync``
record. Each job's figures come from its ``results.json``:

- validation losses: ``curves["val/loss"]``, ``[step, loss]`` pairs (``ValidationRecord``: before the fit, at each
  validation inside it, after it);
- tokens at a step: the step x ``global_batch_size`` x ``seq_len`` (every optimizer step trains on one global
  batch, whatever the mode);
- training time (validation excluded) and bytes sent per process at a step: ``sync["curve"]``, rows
  ``[step, seconds, bytes]`` that ``SyncMonitor`` notes at the fit's start and end and at each validation inside
  it (means over the processes), so exact at every validation step, interpolated between the rows elsewhere;
- the line's name: ``sync["mode"]`` and ``sync["every"]``, else the job's overrides of ``data_parallel_sync``
  (a mode, or a mapping ``{mode:diloco,every:50}``) and ``sync_every``; a job with neither ran ``every_step``.

A job without a ``sync`` record is left out of the time and bytes plots (a note says so). Each PNG has the
report's ``Title`` and ``Series`` text chunks (:class:`~lightning_scale.cli.report_plots.Plotter`) and ``Lines``:
each series' points, ``[x, validation loss]`` in tokens, seconds or bytes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_scale.cli.report_plots import PALETTE, Plotter

__all__ = ["SYNC_PLOTS", "is_sync_study", "plot_sync", "sync_label", "sync_points"]

SYNC_PLOTS = {
    "tokens": ("val_loss_vs_tokens", "Validation loss against tokens", "tokens"),
    "seconds": ("val_loss_vs_time", "Validation loss against training time", "training time (s, validation excluded)"),
    "bytes": ("val_loss_vs_bytes", "Validation loss against bytes sent per process", "bytes sent per process"),
}
"""Each plot's x quantity -> (PNG name, title, x axis)."""

_SYNC_KEYS = ("data_parallel_sync", "sync_every")


def _overrides(job: Mapping[str, Any]) -> dict[str, str]:
    """The job's overrides by their key's last dotted part (``strategy.sync_every=50`` -> ``sync_every: 50``)."""
    found = {}
    for item in job.get("overrides") or []:
        key, _, value = str(item).partition("=")
        found[key.lstrip("+~").rsplit(".", 1)[-1]] = value
    return found


def _mode_and_every(job: Mapping[str, Any]) -> tuple[str, int | None]:
    sync = job.get("sync") or {}
    if sync.get("mode"):
        every = sync.get("every")
        return str(sync["mode"]), int(every) if every is not None else None
    given = _overrides(job)
    value = given.get("data_parallel_sync", "every_step").strip()
    every = given.get("sync_every")
    if value.startswith("{"):  # Hydra's mapping, {mode:diloco,every:50,...}
        mode = re.search(r"mode\s*:\s*'?\"?(\w+)", value)
        inner = re.search(r"every\s*:\s*(\d+)", value)
        value, every = (mode[1] if mode else "?"), (inner[1] if inner else every)
    every = every if every not in (None, "null", "None") else None
    return value.strip("'\""), int(every) if every is not None else None


def sync_label(job: Mapping[str, Any]) -> str:
    """The job's mode and H as a line's name: ``every_step``, ``local_sgd H=10``, ``diloco H=50``."""
    mode, every = _mode_and_every(job)
    return mode if mode == "every_step" or every is None else f"{mode} H={every}"


def is_sync_study(jobs: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the jobs compare synchronisation: they differ in ``data_parallel_sync``/``sync_every``, or any job
    recorded its exchange (``sync``)."""
    if any(job.get("sync") for job in jobs):
        return True
    return len({tuple(_overrides(job).get(k) for k in _SYNC_KEYS) for job in jobs}) > 1


def _at(curve: Sequence[tuple[float, float]], step: float) -> float | None:
    """The curve's value at ``step``: linear between its points, None outside them."""
    for (s0, v0), (s1, v1) in zip(curve, curve[1:]):
        if s0 <= step <= s1:
            return v0 if s1 == s0 else v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    return curve[0][1] if len(curve) == 1 and curve[0][0] == step else None


def sync_points(job: Mapping[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """``{"tokens" | "seconds" | "bytes": [(x, validation loss), ...]}``: the job's validation losses against each
    quantity it recorded (see the module docstring), in step order."""
    val = sorted(((int(s), float(v)) for s, v in (job.get("curves") or {}).get("val/loss") or []), key=lambda p: p[0])
    out: dict[str, list[tuple[float, float]]] = {}
    batch, seq_len = job.get("global_batch_size"), job.get("seq_len")
    if batch and seq_len:
        out["tokens"] = [(float(step * int(batch) * int(seq_len)), loss) for step, loss in val]
    rows = sorted((job.get("sync") or {}).get("curve") or [], key=lambda r: r[0])
    for index, key in ((1, "seconds"), (2, "bytes")):
        curve = [(float(r[0]), float(r[index])) for r in rows]
        points = [(x, loss) for step, loss in val if curve and (x := _at(curve, step)) is not None]
        if points:
            out[key] = points
    return out


def _bytes_unit(top: float) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= scale:
            return scale, unit
    return 1.0, "B"


def plot_sync(plotter: Plotter, jobs: Sequence[dict[str, Any]], job_label: Mapping[int, str]) -> list[str]:
    """The three plots (:data:`SYNC_PLOTS`) of completed ``jobs`` that compare synchronisation, one line per job
    named by :func:`sync_label` (with the report's job label where two jobs share one); returns notes on what
    could not be drawn. Nothing, and no note, when the jobs do not compare synchronisation."""
    if not is_sync_study(jobs):
        return []
    names = [sync_label(j) for j in jobs]
    keys = [_mode_and_every(j) for j in jobs]
    order = sorted(range(len(jobs)), key=lambda i: (names[i] != "every_step", keys[i][0], keys[i][1] or 0, i))
    series = []
    for i in order:
        name = names[i] if names.count(names[i]) == 1 else f"{names[i]} ({job_label[id(jobs[i])]})"
        series.append((name, PALETTE[len(series) % len(PALETTE)], sync_points(jobs[i])))
    notes = []
    unrecorded = [name for name, _, points in series if "bytes" not in points]
    if unrecorded:
        notes.append(
            f"No sync record (results.json's sync, from SyncMonitor under strategy=hybrid) for {', '.join(unrecorded)}: "
            "left out of the plots against training time and bytes."
        )
    for key, (name, title, xlabel) in SYNC_PLOTS.items():
        drawn = [(n, c, points[key]) for n, c, points in series if points.get(key)]
        if not drawn:
            notes.append(f"No job recorded validation losses with {key}: {title} is not drawn.")
            continue
        _lines(plotter, name, title, xlabel, key, drawn)
    return notes


def _lines(
    plotter: Plotter,
    name: str,
    title: str,
    xlabel: str,
    key: str,
    drawn: list[tuple[str, str, list[tuple[float, float]]]],
) -> None:
    fig, ax = plotter.plt.subplots(figsize=(7.5, 4.2))
    scale, unit = _bytes_unit(max(x for *_, pts in drawn for x, _ in pts)) if key == "bytes" else (1.0, "")
    for label, color, points in drawn:
        ax.plot(
            [x / scale for x, _ in points],
            [v for _, v in points],
            "-o",
            color=color,
            linewidth=2,
            markersize=4,
            label=label,
        )
    if key == "bytes":
        positive = [x / scale for *_, pts in drawn for x, _ in pts if x > 0]
        if positive and max(positive) > 20 * min(positive):  # every_step sends H times more: a log axis, 0 kept
            ax.set_xscale("symlog", linthresh=min(positive))
        xlabel = f"{xlabel} ({unit})"
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    plotter.save(
        fig, name, title, [(label, color) for label, color, _ in drawn], Lines={label: pts for label, _, pts in drawn}
    )
