"""``lightning-scale-report <sweep dir>``: what each layout of a sweep cost and delivered.

Reads every job's ``results.json`` and writes ``<sweep dir>/report/``:

- ``report.md`` (plots beside it in ``plots/``) and ``report.html`` (self-contained: the plots
  are embedded, it references no other file);
- PNG plots: throughput against devices with the ideal (linear) line, scaling efficiency, MFU,
  USD per 1M tokens and peak memory per device by layout, and the loss curves overlaid;
- a table of the completed jobs ranked by ``--rank-by`` (skipped and failed jobs listed with why).

``--best`` writes the winner as a strategy config, ``report/conf/strategy/best.yaml``, to pass
straight back: ``lightning-scale-train --config-dir <sweep dir>/report/conf strategy=best``.
``--wandb`` logs the table and plots to a wandb run of the study's group (offline unless logged in).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_scale.cli.sweep import collect_results, wandb_offline

__all__ = ["METRICS", "PALETTE", "Report", "build_report", "main"]


@dataclass(frozen=True)
class Metric:
    label: str
    higher_is_better: bool
    scale: float = 1.0
    unit: str = ""


METRICS: dict[str, Metric] = {
    "tokens_per_sec": Metric("tokens/s", True),
    "tokens_per_sec_per_device": Metric("tokens/s per device", True),
    "mfu": Metric("MFU", True),
    "usd_per_1m_tokens": Metric("USD per 1M tokens", False),
    "peak_memory_bytes": Metric("peak memory per device", False, 2.0**-20, "MiB"),
    "final_val_loss": Metric("final val loss", False),
    "best_val_loss": Metric("best val loss", False),
    "hours_to_target": Metric("hours to target loss", False),
    "usd_to_target": Metric("USD to target loss", False),
    "elapsed_s": Metric("wall time", False, 1.0, "s"),
}
"""The metrics a report can rank by (``--rank-by``), with the better direction."""

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
"""Series colours, in order; each PNG lists its series and their colours in its ``Series`` text chunk."""

_TABLE_METRICS = ("tokens_per_sec", "mfu", "usd_per_1m_tokens", "peak_memory_bytes", "final_val_loss", "best_val_loss")
_LAYOUT_KEYS = ("data_parallel", "tensor_parallel", "pipeline_parallel", "trainer.devices", "trainer.num_nodes")


@dataclass
class Report:
    directory: Path
    markdown: Path
    html: Path
    plots: dict[str, Path]
    ranking: list[dict[str, Any]]
    best_config: Path | None = None
    best_command: str | None = None


def _fmt(value: Any, metric: str) -> str:
    if value is None:
        return "–"
    m = METRICS.get(metric)
    value = float(value) * (m.scale if m else 1.0)
    if metric == "mfu":
        return f"{100 * value:.2f}%"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}" + (f" {m.unit}" if m and m.unit else "")


def _varying(jobs: Sequence[dict[str, Any]]) -> set[str]:
    """Override keys whose values differ between jobs (what the sweep swept)."""
    values: dict[str, list[str]] = {}
    for job in jobs:
        for item in job.get("overrides") or []:
            key, _, value = str(item).partition("=")
            values.setdefault(key, []).append(value)
    return {k for k, v in values.items() if len(set(v)) > 1 or len(v) < len(jobs)}


def _label(job: dict[str, Any], varying: set[str]) -> str:
    extra = []
    for item in job.get("overrides") or []:
        key, _, value = str(item).partition("=")
        if key in varying and not key.endswith(_LAYOUT_KEYS) and key != "strategy":
            extra.append(f"{key.rsplit('.', 1)[-1]}={value}")
    layout = job.get("layout") or "?"
    return f"#{job.get('job')} {layout}" + (f" {','.join(extra)}" if extra else "")


def _ranked(jobs: Sequence[dict[str, Any]], rank_by: str) -> list[dict[str, Any]]:
    metric = METRICS[rank_by]
    done = [j for j in jobs if j.get("status") == "completed"]
    with_value = [j for j in done if j.get(rank_by) is not None]
    without = [j for j in done if j.get(rank_by) is None]
    with_value.sort(key=lambda j: float(j[rank_by]), reverse=metric.higher_is_better)
    return with_value + without


class _Plotter:
    def __init__(self, directory: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt = plt
        self.directory = directory
        self.plots: dict[str, Path] = {}

    def save(self, fig: Any, name: str, title: str, series: list[tuple[str, str]]) -> None:
        path = self.directory / f"{name}.png"
        meta = {"Title": title, "Series": json.dumps([{"name": n, "color": c} for n, c in series]), "Software": "lightning-scale"}
        fig.tight_layout()
        fig.savefig(path, dpi=100, metadata=meta)
        self.plt.close(fig)
        self.plots[name] = path

    def bars(self, name: str, title: str, labels: list[str], values: list[float], ylabel: str, series: str) -> None:
        fig, ax = self.plt.subplots(figsize=(max(5.0, 0.9 * len(labels) + 2), 4))
        color = PALETTE[0]
        ax.bar(range(len(values)), values, color=color, label=series)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        self.save(fig, name, title, [(series, color)])


def _scaling(jobs: list[dict[str, Any]]) -> tuple[list[int], list[float], list[float]] | None:
    """(device counts, best measured tokens/s at each, ideal tokens/s at each)."""
    best: dict[int, float] = {}
    for job in jobs:
        rate, world = job.get("tokens_per_sec"), job.get("world_size")
        if rate is not None and world:
            best[int(world)] = max(best.get(int(world), 0.0), float(rate))
    if not best:
        return None
    devices = sorted(best)
    base = devices[0]
    return devices, [best[d] for d in devices], [best[base] * d / base for d in devices]


def _plot_all(plotter: _Plotter, jobs: list[dict[str, Any]], labels: dict[int, str]) -> list[str]:
    """Draw every plot the data allows; returns notes on those it could not draw."""
    plt, notes = plotter.plt, []
    scaling = _scaling(jobs)
    if scaling is None:
        notes.append("No job logged throughput (train/tokens_per_sec): the throughput callback was off.")
    else:
        devices, measured, ideal = scaling
        fig, ax = plt.subplots(figsize=(5.5, 4))
        points = [(j["world_size"], j["tokens_per_sec"]) for j in jobs if j.get("tokens_per_sec") is not None]
        ax.plot(devices, ideal, "--s", color=PALETTE[9], linewidth=2, markersize=7, label="ideal")
        ax.plot(devices, measured, "-o", color=PALETTE[0], linewidth=2.5, label="measured")
        ax.scatter([p[0] for p in points], [p[1] for p in points], color=PALETTE[0], s=18, zorder=3)
        ax.set_xlabel("devices")
        ax.set_ylabel("tokens/s")
        ax.set_xticks(devices)
        ax.set_title("Throughput against devices")
        ax.legend()
        ax.grid(alpha=0.3)
        plotter.save(fig, "throughput_vs_devices", "Throughput against devices", [("measured", PALETTE[0]), ("ideal", PALETTE[9])])
        fig, ax = plt.subplots(figsize=(5.5, 4))
        efficiency = [m / i for m, i in zip(measured, ideal, strict=True)]
        ax.axhline(1.0, linestyle="--", color=PALETTE[9], linewidth=2, label="ideal")
        ax.plot(devices, efficiency, "-o", color=PALETTE[2], linewidth=2.5, label="efficiency")
        ax.set_xlabel("devices")
        ax.set_ylabel("measured / ideal throughput")
        ax.set_xticks(devices)
        ax.set_ylim(0, max(1.1, max(efficiency) * 1.1))
        ax.set_title("Scaling efficiency")
        ax.legend()
        ax.grid(alpha=0.3)
        plotter.save(fig, "scaling_efficiency", "Scaling efficiency", [("efficiency", PALETTE[2]), ("ideal", PALETTE[9])])
    for key, name, title in (
        ("mfu", "mfu_by_layout", "MFU by layout"),
        ("usd_per_1m_tokens", "usd_per_1m_tokens_by_layout", "USD per 1M tokens by layout"),
        ("peak_memory_bytes", "memory_per_device", "Peak memory per device"),
    ):
        have = [j for j in jobs if j.get(key) is not None]
        if not have:
            notes.append(f"No job recorded {key}: {title} is not drawn.")
            continue
        m = METRICS[key]
        values = [float(j[key]) * (100 if key == "mfu" else m.scale) for j in have]
        unit = "%" if key == "mfu" else m.unit
        plotter.bars(name, title, [labels[id(j)] for j in have], values, f"{m.label}" + (f" ({unit})" if unit else ""), key)
    curves = [(j, (j.get("curves") or {}).get("train/loss") or [], (j.get("curves") or {}).get("val/loss") or []) for j in jobs]
    curves = [c for c in curves if c[1] or c[2]]
    if not curves:
        notes.append("No loss curves were recorded.")
        return notes
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    series = []
    for i, (job, train, val) in enumerate(curves):
        color = PALETTE[i % len(PALETTE)]
        label = labels[id(job)]
        if train:
            ax.plot([s for s, _ in train], [v for _, v in train], "-", color=color, linewidth=2, label=f"{label} train")
        if val:
            ax.plot([s for s, _ in val], [v for _, v in val], "--o", color=color, linewidth=2, markersize=3, label=f"{label} val")
        series.append((label, color))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss curves")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    plotter.save(fig, "loss_curves", "Loss curves", series)
    return notes


def _table(rows: list[dict[str, Any]], labels: dict[int, str], rank_by: str) -> tuple[list[str], list[list[str]]]:
    metrics = [rank_by] + [m for m in _TABLE_METRICS if m != rank_by]
    header = ["rank", "job", "precision", "global batch", *[METRICS[m].label for m in metrics]]
    body = []
    for i, job in enumerate(rows, 1):
        body.append([str(i), labels[id(job)], str(job.get("precision", "")), str(job.get("global_batch_size", "")),
                     *[_fmt(job.get(m), m) for m in metrics]])  # fmt: skip
    return header, body


def _markdown_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in body]
    return "\n".join(lines)


def _html_table(header: list[str], body: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def _write_best(directory: Path, job: dict[str, Any], rank_by: str) -> tuple[Path, str]:
    from omegaconf import OmegaConf

    resolved = Path(job["job_dir"]) / "resolved_config.yaml"
    if not resolved.is_file():
        raise ValueError(f"--best: the winning job has no {resolved}, so its strategy is unknown.")
    cfg = OmegaConf.load(resolved)
    conf = directory / "conf"
    target = conf / "strategy" / "best.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    strategy = cfg.strategy
    sizes = job.get("layout_sizes") or {}
    if str(strategy.get("_target_", "")).endswith("HybridParallelStrategy") and sizes:
        strategy.data_parallel, strategy.tensor_parallel, strategy.pipeline_parallel = sizes["dp"], sizes["tp"], sizes["pp"]
    node = OmegaConf.create({"strategy": strategy, "trainer": {"devices": cfg.trainer.devices, "num_nodes": cfg.trainer.num_nodes}})
    command = f"lightning-scale-train --config-dir {conf.resolve()} strategy=best"
    text = (
        "# @package _global_\n"
        f"# The best layout of study {job.get('study')} by {rank_by}: job {job.get('job')}, {job.get('layout')} "
        f"({_fmt(job.get(rank_by), rank_by)}).\n# Train with it:\n#   {command}\n" + OmegaConf.to_yaml(node)
    )
    target.write_text(text)
    return target, command


def _log_wandb(jobs: list[dict[str, Any]], header: list[str], body: list[list[str]], plots: dict[str, Path], directory: Path) -> str:
    import wandb

    study = next((j.get("study") for j in jobs if j.get("study")), None)
    run = wandb.init(
        project="lightning-scale", group=study, job_type="report", name=f"{study}/report", dir=str(directory),
        mode="offline" if wandb_offline() else "online", reinit="finish_previous",
    )  # fmt: skip
    try:
        run.log({"ranking": wandb.Table(columns=header, data=body), **{name: wandb.Image(str(p)) for name, p in plots.items()}})
        return run.id
    finally:
        run.finish()


def build_report(
    sweep_dir: str | Path | Sequence[str | Path],
    *,
    rank_by: str = "tokens_per_sec",
    best: bool = False,
    use_wandb: bool = False,
    out: str | Path | None = None,
) -> Report:
    """Write the report of the sweep in ``sweep_dir`` (see the module docstring), or of several
    sweeps together (e.g. one per device count on SLURM); ``ValueError`` on bad input."""
    if rank_by not in METRICS:
        raise ValueError(f"--rank-by {rank_by!r} is not a metric a report ranks by. Valid: {', '.join(METRICS)}.")
    sweeps = [Path(sweep_dir)] if isinstance(sweep_dir, (str, Path)) else [Path(d) for d in sweep_dir]
    if not sweeps:
        raise ValueError("No sweep directory given: pass multirun/<study>.")
    jobs = []
    for sweep in sweeps:
        if not sweep.is_dir():
            raise ValueError(f"{sweep} is not a directory: pass a sweep directory, e.g. multirun/<study>.")
        found = collect_results(sweep)
        if not found:
            raise ValueError(
                f"No results.json under {sweep}: this is not a sweep directory whose jobs ran (jobs write "
                "<sweep dir>/<job>/results.json). Pass multirun/<study> of a sweep that started."
            )
        jobs += [{**j, "job": j.get("job") if len(sweeps) == 1 else f"{j.get('study') or sweep.name}/{j.get('job')}"} for j in found]
    sweep = sweeps[0]
    ranking = _ranked(jobs, rank_by)
    winners = [j for j in ranking if j.get(rank_by) is not None]
    if best and not winners:
        raise ValueError(f"--best: no completed job recorded {rank_by}, so there is no winner to write. Rank by another metric.")
    directory = Path(out) if out is not None else sweep / "report"
    (directory / "plots").mkdir(parents=True, exist_ok=True)
    varying = _varying(jobs)
    labels = {id(j): _label(j, varying) for j in jobs}
    done = [j for j in jobs if j.get("status") == "completed"]
    plotter = _Plotter(directory / "plots")
    notes = _plot_all(plotter, done, labels) if done else ["No job completed: nothing to plot."]
    header, body = _table(ranking, labels, rank_by)
    others = [j for j in jobs if j.get("status") != "completed"]
    metric = METRICS[rank_by]
    order = "highest" if metric.higher_is_better else "lowest"
    study = next((j.get("study") for j in jobs if j.get("study")), sweep.name)

    counts = {s: sum(j.get("status") == s for j in jobs) for s in ("completed", "skipped", "failed")}
    where = ", ".join(f"`{d}`" for d in sweeps)
    md = [
        f"# Sweep report: {study}",
        "",
        f"{len(jobs)} jobs in {where}: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".",
        "",
        f"## Ranking by {metric.label} ({order} first)",
        "",
        _markdown_table(header, body) if body else "(no completed job)",
        "",
    ]
    if others:
        md += ["## Not completed", ""] + [f"- {labels[id(j)]}: **{j.get('status')}**: {j.get('reason', '')}" for j in others] + [""]
    md += ["## Plots", ""] + [f"![{name}](plots/{p.name})" for name, p in plotter.plots.items()] + [""]
    md += [f"- {n}" for n in notes]
    best_config = best_command = None
    if best:
        best_config, best_command = _write_best(directory, winners[0], rank_by)
        md += ["", "## Best layout", "", f"`{best_config}`; train with it:", "", f"    {best_command}"]
    markdown = directory / "report.md"
    markdown.write_text("\n".join(md) + "\n")

    images = "".join(
        f"<figure><img alt='{name}' src='data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}'/></figure>"
        for name, p in plotter.plots.items()
    )
    not_done = "".join(f"<li>{html.escape(labels[id(j)])}: <b>{j.get('status')}</b>: {html.escape(str(j.get('reason', '')))}</li>" for j in others)
    page = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Sweep report: "
        f"{html.escape(str(study))}</title><style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}img{max-width:48%;margin:4px}</style></head><body>"
        f"<h1>Sweep report: {html.escape(str(study))}</h1><h2>Ranking by {html.escape(metric.label)} ({order} first)</h2>"
        f"{_html_table(header, body)}" + (f"<h2>Not completed</h2><ul>{not_done}</ul>" if others else "")
        + f"<h2>Plots</h2>{images}" + "".join(f"<p>{html.escape(n)}</p>" for n in notes)
        + (f"<h2>Best layout</h2><pre>{html.escape(best_command)}</pre>" if best_command else "") + "</body></html>"
    )
    page_path = directory / "report.html"
    page_path.write_text(page)
    (directory / "ranking.json").write_text(json.dumps([{k: v for k, v in j.items() if k != "curves"} for j in ranking], indent=2, default=str))
    if use_wandb:
        _log_wandb(jobs, header, body, plotter.plots, directory)
    return Report(directory, markdown, page_path, plotter.plots, ranking, best_config, best_command)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-scale-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", nargs="+", help="a sweep directory, multirun/<study> (several: one report of them all)")
    parser.add_argument("--rank-by", default="tokens_per_sec", help=f"one of: {', '.join(METRICS)}")
    parser.add_argument("--best", action="store_true", help="write the winner as report/conf/strategy/best.yaml")
    parser.add_argument("--wandb", action="store_true", help="log the table and plots to a wandb run of the study")
    parser.add_argument("--out", default=None, help="report directory (default: <sweep dir>/report)")
    args = parser.parse_args(argv)
    try:
        report = build_report(args.sweep_dir, rank_by=args.rank_by, best=args.best, use_wandb=args.wandb, out=args.out)
    except ValueError as err:
        print(f"lightning-scale-report: error: {err}", file=sys.stderr)
        return 2
    print(f"report: {report.markdown}\n        {report.html}")
    if report.best_command:
        print(f"best layout: {report.best_config}\n  {report.best_command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
