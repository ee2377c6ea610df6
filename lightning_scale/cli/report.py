"""``lightning-scale-report <sweep dir>``: what each layout of a sweep cost and delivered.

Reads every job's ``results.json`` and writes ``<sweep dir>/report/``:

- ``report.md`` (plots beside it in ``plots/``) and ``report.html`` (self-contained: the plots
  are embedded, it references no other file);
- PNG plots (``report_plots``): throughput, USD per 1M tokens, MFU and peak memory per device as
  labelled bars, one per configuration, best first, with the min..max of its repeats; throughput
  against devices with the ideal (linear) line and scaling efficiency when the sweep varies the
  device count; the loss curves overlaid; when the jobs compare data-parallel synchronisation
  (``experiment=sync_sweep``), validation loss against tokens, training time and bytes sent per process,
  one line per mode and H (``report_sync``);
- a warning at the top when throughput is noisy (repeats that disagree, a busy machine);
- a table of the completed jobs ranked by ``--rank-by``, with their devices and, when devices vary,
  scaling efficiency (skipped and failed jobs listed with why). Several sweeps make one report,
  titled with every study.

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

from lightning_scale.cli.environment import wandb_offline
from lightning_scale.cli.report_plots import (
    PALETTE,
    Plotter,
    efficiency_base,
    group_jobs,
    no_throughput_note,
    noise,
    planner_table,
    plot_all,
)
from lightning_scale.cli.report_sync import plot_sync
from lightning_scale.cli.results import collect_results, describe_totals, study_totals

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


def _table(
    rows: list[dict[str, Any]], labels: dict[int, str], rank_by: str, base: float | None = None
) -> tuple[list[str], list[list[str]]]:
    """The ranking as a table; with ``base`` (tokens/s per device at the smallest device count, when
    the sweep varies devices) a scaling-efficiency column: each job's tokens/s per device over it."""
    metrics = [rank_by] + [m for m in _TABLE_METRICS if m != rank_by]
    header = ["rank", "job", "devices", "precision", "global batch", *[METRICS[m].label for m in metrics], "goodput"]
    header += ["scaling efficiency"] if base else []
    body = []
    for i, job in enumerate(rows, 1):
        goodput = (job.get("goodput") or {}).get("goodput") if isinstance(job.get("goodput"), dict) else None
        row = [
            str(i),
            labels[id(job)],
            str(job.get("world_size", "")),
            str(job.get("precision", "")),
            str(job.get("global_batch_size", "")),
            *[_fmt(job.get(m), m) for m in metrics],
            f"{float(goodput):.1%}" if isinstance(goodput, (int, float)) else "–",
        ]
        if base:
            rate, world = job.get("tokens_per_sec"), job.get("world_size")
            row.append(f"{float(rate) / int(world) / base:.0%}" if rate is not None and world else "–")
        body.append(row)
    return header, body


def _markdown_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in body]
    return "\n".join(lines)


def _html_table(header: list[str], body: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


_NOT_CARRIED = ("hydra", "hydra/", "study", "sweep", "run_dir", "ckpt_path", "experiment")


def yaml_value(text: str) -> Any:
    """A command line's list value (``[csv,wandb]``) as YAML reads it."""
    import yaml

    return yaml.safe_load(text)


def _default_choice(group: str) -> str | None:
    """The group's choice in the package's primary config (``conf/config.yaml``)."""
    import yaml

    from lightning_scale import conf

    defaults = yaml.safe_load((Path(conf.__file__).parent / "config.yaml").read_text()).get("defaults", [])
    return next((str(d[group]) for d in defaults if isinstance(d, dict) and group in d), None)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_best(
    directory: Path, job: dict[str, Any], rank_by: str, varying: set[str] = frozenset()
) -> tuple[Path, str]:  # type: ignore[assignment]
    """The winner as ``strategy/best.yaml`` (package ``_global_``): its layout and device count, its
    precision and global batch, and every value that differed between the jobs (a group choice such as
    ``precision=bf16`` as the whole node the job ran with)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

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
        strategy.data_parallel, strategy.tensor_parallel, strategy.pipeline_parallel = (
            sizes["dp"],
            sizes["tp"],
            sizes["pp"],
        )
    node = OmegaConf.create(
        {"strategy": strategy, "trainer": {"devices": cfg.trainer.devices, "num_nodes": cfg.trainer.num_nodes}}
    )
    if OmegaConf.select(cfg, "data.global_batch_size") is not None:
        OmegaConf.update(node, "data.global_batch_size", cfg.data.global_batch_size)
    # Group choices (precision=bf16) go into the defaults list: a group later in the primary defaults would
    # otherwise replace a node written here. The precision always; other groups when they differed.
    groups: dict[str, Any] = {}
    recorded_choice = (_read_json(Path(job["job_dir"]) / "job.json") or {}).get("precision_choice")
    if recorded_choice and recorded_choice != _default_choice("precision"):
        groups["precision"] = recorded_choice
    for item in job.get("overrides") or []:
        raw, _, text = str(item).partition("=")
        key = raw.lstrip("+~")
        if key.startswith(_NOT_CARRIED) or key.startswith("strategy") or (key not in varying and key != "precision"):
            continue
        if "." not in key and "/" not in key and isinstance(cfg.get(key), (DictConfig, ListConfig)):
            groups[key] = yaml_value(text) if text.startswith("[") else text
            continue
        value = OmegaConf.select(cfg, key.replace("/", "."), default=None)
        if value is not None:
            OmegaConf.update(node, key.replace("/", "."), value, force_add=True)
    command = f"lightning-scale-train --config-dir {conf.resolve()} strategy=best"
    header = (
        "# @package _global_\n"
        f"# The best layout of study {job.get('study')} by {rank_by}: job {job.get('job')}, {job.get('layout')} "
        f"({_fmt(job.get(rank_by), rank_by)}).\n"
    )
    if groups:
        # A group config (strategy/best) cannot choose groups that come after it in the defaults (precision):
        # experiment/best, last in the defaults, chooses them and strategy=best.
        command = f"lightning-scale-train --config-dir {conf.resolve()} experiment=best"
        experiment = OmegaConf.create(
            {
                "defaults": [
                    {"override /strategy": "best"},
                    *({f"override /{k}": v} for k, v in groups.items()),
                    "_self_",
                ]
            }
        )
        (conf / "experiment").mkdir(parents=True, exist_ok=True)
        (conf / "experiment" / "best.yaml").write_text(
            header
            + f"# Its layout is strategy/best.yaml; here its other choices. Train with it:\n#   {command}\n"
            + OmegaConf.to_yaml(experiment)
        )
    text = header + f"# Train with it:\n#   {command}\n" + OmegaConf.to_yaml(node)
    target.write_text(text)
    return target, command


def _log_wandb(
    jobs: list[dict[str, Any]], header: list[str], body: list[list[str]], plots: dict[str, Path], directory: Path
) -> str:
    import wandb

    study = next((j.get("study") for j in jobs if j.get("study")), None)
    run = wandb.init(
        project="lightning-scale",
        group=study,
        job_type="report",
        name=f"{study}/report",
        dir=str(directory),
        mode="offline" if wandb_offline() else "online",
        reinit="finish_previous",
    )
    try:
        run.log(
            {
                "ranking": wandb.Table(columns=header, data=body),
                **{name: wandb.Image(str(p)) for name, p in plots.items()},
            }
        )
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
    jobs, studies = [], []
    for sweep in sweeps:
        if not sweep.is_dir():
            raise ValueError(f"{sweep} is not a directory: pass a sweep directory, e.g. multirun/<study>.")
        found = collect_results(sweep)
        if not found:
            raise ValueError(
                f"No results.json under {sweep}: this is not a sweep directory whose jobs ran (jobs write "
                "<sweep dir>/<job>/results.json). Pass multirun/<study> of a sweep that started."
            )
        studies.append(next((str(j["study"]) for j in found if j.get("study")), sweep.name))
        jobs += [
            {**j, "job": j.get("job") if len(sweeps) == 1 else f"{j.get('study') or sweep.name}/{j.get('job')}"}
            for j in found
        ]
    sweep = sweeps[0]
    done = [j for j in jobs if j.get("status") == "completed"]
    if done and all(j.get(rank_by) is None for j in done):
        recorded = [m for m in METRICS if any(j.get(m) is not None for j in done)]
        hint = no_throughput_note(done) if rank_by in ("tokens_per_sec", "tokens_per_sec_per_device", "mfu") else ""
        raise ValueError(
            f"--rank-by {rank_by}: no completed job recorded {rank_by}, so there is no ranking by it. "
            f"Recorded: {', '.join(recorded) or 'none'}; rank by one of those." + (f" {hint}" if hint else "")
        )
    ranking = _ranked(jobs, rank_by)
    winners = [j for j in ranking if j.get(rank_by) is not None]
    if best and not winners:
        raise ValueError(
            f"--best: no completed job recorded {rank_by}, so there is no winner to write. Rank by another metric."
        )
    directory = Path(out) if out is not None else sweep / "report"
    (directory / "plots").mkdir(parents=True, exist_ok=True)
    varying = _varying(jobs)
    labels = {id(j): _label(j, varying) for j in jobs}
    done = [j for j in jobs if j.get("status") == "completed"]
    plotter = Plotter(directory / "plots")
    notes = plot_all(plotter, done, labels, METRICS) if done else ["No job completed: nothing to plot."]
    notes += plot_sync(plotter, done, labels)
    groups = group_jobs(done)
    warnings, noise_notes = noise(groups, labels)
    notes += noise_notes
    header, body = _table(ranking, labels, rank_by, efficiency_base(groups))
    others = [j for j in jobs if j.get("status") != "completed"]
    metric = METRICS[rank_by]
    order = "highest" if metric.higher_is_better else "lowest"
    study = ", ".join(dict.fromkeys(studies))  # a combined report names every study

    counts = {s: sum(j.get("status") == s for j in jobs) for s in ("completed", "skipped", "failed")}
    summary = f"{len(jobs)} jobs in {{}}: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + "."
    totals = f"Study totals: {describe_totals(study_totals(jobs))}."
    md = [
        f"# Sweep report: {study}",
        "",
        summary.format(", ".join(f"`{d}`" for d in sweeps)),
        "",
        totals,
        "",
        *[f"> **Warning:** {w}" + ("  " if i < len(warnings) - 1 else "") for i, w in enumerate(warnings)],
        *([""] if warnings else []),
        f"## Ranking by {metric.label} ({order} first)",
        "",
        _markdown_table(header, body) if body else "(no completed job)",
        "",
    ]
    if planner := planner_table(ranking, labels):
        header_p, body_p, note = planner
        md += ["## Planner: predicted and measured", "", note, "", _markdown_table(header_p, body_p), ""]
    if others:
        md += (
            ["## Not completed", ""]
            + [f"- {labels[id(j)]}: **{j.get('status')}**: {j.get('reason', '')}" for j in others]
            + [""]
        )
    md += ["## Plots", ""] + [f"![{name}](plots/{p.name})" for name, p in plotter.plots.items()] + [""]
    md += [f"- {n}" for n in notes]
    best_config = best_command = None
    if best:
        best_config, best_command = _write_best(directory, winners[0], rank_by, varying)
        md += ["", "## Best layout", "", f"`{best_config}`; train with it:", "", f"    {best_command}"]
    markdown = directory / "report.md"
    markdown.write_text("\n".join(md) + "\n")

    images = "".join(
        f"<figure><img alt='{name}' src='data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}'/></figure>"
        for name, p in plotter.plots.items()
    )
    warning = "".join(f"<p>{html.escape(w)}</p>" for w in warnings)
    style = (
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td{white-space:nowrap}"
        ".warning{background:#fff3cd;border:2px solid #c69500;padding:4px 12px;margin:1em 0;max-width:60em}"
        ".plots{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}"
        "figure{margin:0;flex:0 1 48%}img{max-width:100%;height:auto}"
    )
    not_done = "".join(
        f"<li>{html.escape(labels[id(j)])}: <b>{j.get('status')}</b>: {html.escape(str(j.get('reason', '')))}</li>"
        for j in others
    )
    page = (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Sweep report: {html.escape(study)}</title>"
        f"<style>{style}</style></head><body><h1>Sweep report: {html.escape(study)}</h1>"
        f"<p>{html.escape(summary.format(', '.join(map(str, sweeps))))}</p><p>{html.escape(totals)}</p>"
        + (f"<div class='warning'><b>Warning</b>{warning}</div>" if warnings else "")
        + f"<h2>Ranking by {html.escape(metric.label)} ({order} first)</h2>"
        f"{_html_table(header, body)}"
        + (f"<h2>Not completed</h2><ul>{not_done}</ul>" if others else "")
        + f"<h2>Plots</h2><div class='plots'>{images}</div>"
        + "".join(f"<p>{html.escape(n)}</p>" for n in notes)
        + (f"<h2>Best layout</h2><pre>{html.escape(best_command)}</pre>" if best_command else "")
        + "</body></html>"
    )
    page_path = directory / "report.html"
    page_path.write_text(page)
    (directory / "ranking.json").write_text(
        json.dumps([{k: v for k, v in j.items() if k != "curves"} for j in ranking], indent=2, default=str)
    )
    if use_wandb:
        _log_wandb(jobs, header, body, plotter.plots, directory)
    return Report(directory, markdown, page_path, plotter.plots, ranking, best_config, best_command)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-scale-report", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "sweep_dir", nargs="+", help="a sweep directory, multirun/<study> (several: one report of them all)"
    )
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
