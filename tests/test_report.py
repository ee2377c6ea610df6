"""`lightning-scale-report` read as a person reads it: which layout wins, by how much, and whether the
measurement can be trusted. Built from the ``results.json`` files a sweep writes, for a layout sweep
(one device count, repeats) and a device-count sweep, and screenshot in headless Chromium."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from lightning_scale.cli import report_plots
from lightning_scale.cli.report import PALETTE, build_report

# (tp, pp) -> tokens/s on 4 devices; the repeats of tp=1 pp=2 disagree by 20% (over the 5% rule).
LAYOUT_RATES = {(1, 1): 3000.0, (2, 1): 2400.0, (1, 2): 2000.0, (2, 2): 1500.0}
NOISY, REPEATS = (1, 2), (0.99, 1.0, 1.01)


def _write_job(
    study: Path,
    job: int,
    *,
    world: int,
    tp: int = 1,
    pp: int = 1,
    rate: float,
    overrides: list[str],
    precision: str = "bf16-mixed",
    **extra: Any,
) -> None:
    """One job's ``results.json`` as ``results.job_results`` writes it."""
    dp = world // (tp * pp)
    doc = {
        "status": "completed",
        "study": study.name,
        "job": job,
        "layout": f"dp{dp}-tp{tp}-pp{pp}",
        "layout_sizes": {
            "name": f"dp{dp}-tp{tp}-pp{pp}",
            "dp": dp,
            "tp": tp,
            "pp": pp,
            "mode": "ddp",
            "world_size": world,
        },
        "overrides": overrides,
        "precision": precision,
        "world_size": world,
        "num_nodes": 1,
        "accelerator": "cuda",
        "global_batch_size": 32,
        "seq_len": 256,
        "tokens_per_sec": rate,
        "tokens_per_sec_per_device": rate / world,
        "mfu": rate / 10_000,
        "usd_per_1m_tokens": 4000.0 / rate,
        "peak_memory_bytes": int(4096 / (tp * pp)) * 2**20,
        "final_val_loss": 2.5,
        "best_val_loss": 2.45,
        "cpu_count": 16,
        "elapsed_s": 100.0,
        "curves": {"train/loss": [[s, 5.0 - s / 100 - job / 50] for s in range(0, 101, 25)], "val/loss": [[100, 2.5]]},
        **extra,
    }
    (study / str(job)).mkdir(parents=True)
    (study / str(job) / "results.json").write_text(json.dumps(doc))


def _layout_sweep(root: Path) -> Path:
    """tp x pp on 4 devices, each layout run 3 times (``+repeat=0,1,2``), on an idle machine."""
    study = root / "multirun" / "layout_sweep-1a2b3c4d"
    job = 0
    for (tp, pp), rate in LAYOUT_RATES.items():
        for repeat, factor in enumerate((0.9, 1.0, 1.1) if (tp, pp) == NOISY else REPEATS):
            overrides = [f"strategy.tensor_parallel={tp}", f"strategy.pipeline_parallel={pp}", f"+repeat={repeat}"]
            _write_job(
                study,
                job,
                world=4,
                tp=tp,
                pp=pp,
                rate=rate * factor,
                overrides=overrides,
                load_average={"start": 0.2, "end": 3.9},
            )
            job += 1
    return study


def _device_sweep(
    root: Path, name: str = "scaling_strong-5e6f7a8b", devices: tuple[int, ...] = (1, 2, 4), **extra: Any
) -> Path:
    """Data parallelism on 1, 2, 4 devices, once each (tokens/s 1000, 1900, 3500)."""
    study = root / "multirun" / name
    for job, world in enumerate(devices):
        rate = {1: 1000.0, 2: 1900.0, 4: 3500.0, 8: 6000.0}[world]
        _write_job(study, job, world=world, rate=rate, overrides=[f"trainer.devices={world}"], **extra)
    return study


def _chunks(path: Path) -> dict[str, Any]:
    """A report PNG's text chunks (``Series``, ``Bars``), after checking it is a real, drawn image."""
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size[0] > 200 and img.size[1] > 200, (path.name, img.size)
        colours = {c for _, c in img.convert("RGB").getcolors(maxcolors=1 << 20)}
        chunks = {k: json.loads(v) for k, v in img.text.items() if k in ("Series", "Bars")}
    for s in chunks["Series"]:  # every series it names is drawn: its colour is in the image
        assert tuple(int(s["color"][i : i + 2], 16) for i in (1, 3, 5)) in colours, (path.name, s)
    return chunks


def _table(md: str) -> list[dict[str, str]]:
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[1:]]


@pytest.fixture
def legends_outside(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Checks, as each figure is saved, that no legend lies over its axes; returns the names seen."""
    seen, save = [], report_plots.Plotter.save

    def checked(self: Any, fig: Any, name: str, *args: Any, **kwargs: Any) -> None:
        fig.canvas.draw()
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is not None:
                box, data = legend.get_window_extent(), ax.get_window_extent()
                assert not box.overlaps(data), f"{name}: the legend lies over the plot"
        seen.append(name)
        save(self, fig, name, *args, **kwargs)

    monkeypatch.setattr(report_plots.Plotter, "save", checked)
    return seen


def test_a_layout_sweep_is_bars_per_layout_best_first_with_the_spread_of_its_repeats(
    tmp_path: Path, legends_outside: list[str]
) -> None:
    report = build_report(_layout_sweep(tmp_path))
    plots = report.directory / "plots"
    # One device count: no throughput-against-devices line, no single-point efficiency plot.
    assert set(report.plots) == {
        "throughput_by_layout",
        "usd_per_1m_tokens_by_layout",
        "mfu_by_layout",
        "memory_per_device",
        "loss_curves",
    }
    assert not (plots / "throughput_vs_devices.png").exists() and not (plots / "scaling_efficiency.png").exists()
    assert set(legends_outside) == set(report.plots)
    bars = _chunks(plots / "throughput_by_layout.png")["Bars"]
    assert [b["label"] for b in bars] == ["tp=1 pp=1", "tp=2 pp=1", "tp=1 pp=2", "tp=2 pp=2"]  # fastest first
    assert [b["runs"] for b in bars] == [3, 3, 3, 3]
    assert [round(b["value"]) for b in bars] == [3000, 2400, 2000, 1500]  # the median of the repeats
    assert (round(bars[2]["min"]), round(bars[2]["max"])) == (1800, 2200)
    cost = _chunks(plots / "usd_per_1m_tokens_by_layout.png")["Bars"]
    assert [b["label"] for b in cost] == ["tp=1 pp=1", "tp=2 pp=1", "tp=1 pp=2", "tp=2 pp=2"]  # cheapest first
    md = report.markdown.read_text()
    rows = _table(md)
    assert len(rows) == 12 and {r["devices"] for r in rows} == {"4"} and "scaling efficiency" not in rows[0]
    # The repeats of tp=1 pp=2 differ by 20%: a visible warning, naming them and the rule.
    (warning,) = [line for line in md.splitlines() if line.startswith("> **Warning:**") and "tp=1 pp=2" in line]
    assert "differ by 20% in tokens/s" in warning and "over 5%" in warning
    assert not any("tp=1 pp=1:" in line for line in md.splitlines() if line.startswith("> "))  # 2% apart: no warning
    assert "class='warning'" in report.html.read_text()


def test_a_device_count_sweep_has_scaling_plots_and_an_efficiency_column(
    tmp_path: Path, legends_outside: list[str]
) -> None:
    report = build_report(_device_sweep(tmp_path))
    plots = report.directory / "plots"
    assert (
        set(legends_outside)
        == set(report.plots)
        >= {"throughput_vs_devices", "scaling_efficiency", "throughput_by_layout"}
    )
    assert {s["name"] for s in _chunks(plots / "throughput_vs_devices.png")["Series"]} == {"measured", "ideal"}
    bars = _chunks(plots / "throughput_by_layout.png")["Bars"]
    assert [(b["label"], b["value"], b["runs"]) for b in bars] == [
        ("devices=4", 3500, 1),
        ("devices=2", 1900, 1),
        ("devices=1", 1000, 1),
    ]
    md = report.markdown.read_text()
    # tokens/s per device against one device's 1000: 1900 / 2 = 95%, 3500 / 4 = 88%.
    assert [(r["job"], r["devices"], r["scaling efficiency"]) for r in _table(md)] == [
        ("#2 dp4-tp1-pp1", "4", "88%"),
        ("#1 dp2-tp1-pp1", "2", "95%"),
        ("#0 dp1-tp1-pp1", "1", "100%"),
    ]
    assert "**Warning:**" not in md
    # The study's totals (the synthetic jobs record 100 s each and $ from their rate): 100 s on 1+2+4 devices.
    assert "Study totals: 3 jobs ran: 0.194 device-hours, 0.0833 h of jobs, no cost recorded" in md
    assert "No configuration was repeated" in md and "did not record the machine's load" in md


def test_a_busy_machine_makes_the_report_warn(tmp_path: Path) -> None:
    idle = build_report(_device_sweep(tmp_path / "idle", load_average={"start": 0.3, "end": 2.0}))
    assert (
        "**Warning:**" not in idle.markdown.read_text()
        and "did not record the machine's load" not in idle.markdown.read_text()
    )
    study = _device_sweep(tmp_path / "busy", load_average={"start": 0.3, "end": 2.0})
    doc = json.loads((study / "1" / "results.json").read_text())
    (study / "1" / "results.json").write_text(json.dumps({**doc, "load_average": {"start": 3.5, "end": 5.0}}))
    md = build_report(study).markdown.read_text()
    assert (
        "> **Warning:** 1 of 3 jobs started on a busy machine (1-minute load average >= 1): #1 dp2-tp1-pp1 (3.5 on 16 CPUs)."
        in md
    )


def test_a_combined_report_is_titled_with_every_study(tmp_path: Path) -> None:
    one = _device_sweep(tmp_path, "scale-1", devices=(1,))
    two = _device_sweep(tmp_path, "scale-4", devices=(4,))
    report = build_report([one, two], out=tmp_path / "report")
    assert report.markdown.read_text().startswith("# Sweep report: scale-1, scale-4\n")
    page = report.html.read_text()
    assert "<title>Sweep report: scale-1, scale-4</title>" in page and "<h1>Sweep report: scale-1, scale-4</h1>" in page
    assert "throughput_vs_devices" in report.plots  # devices vary across the studies


# --- the page as a person sees it -------------------------------------------------------------------------


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.images.append(dict(attrs))


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    pytest.fail(
        "Chromium is not installed, so the report cannot be checked as a person sees it. Install it "
        "(Debian: apt-get install -y --no-install-recommends chromium; .ci/run does) and rerun."
    )


def _loaded(data: bytes, what: str) -> Image.Image:
    """A PNG that loads, is of a readable size and is not one colour (something is drawn)."""
    img = Image.open(io.BytesIO(data))
    assert img.format == "PNG", what
    img = img.convert("RGB")
    assert img.size[0] > 200 and img.size[1] > 200, (what, img.size)
    assert len(img.getcolors(maxcolors=1 << 24)) > 10, f"{what} is blank"
    return img


@pytest.mark.parametrize("sweep", ["layout", "devices"])
def test_the_report_screenshot_shows_every_plot(tmp_path: Path, sweep: str) -> None:
    chromium = _chromium()
    report = build_report(_layout_sweep(tmp_path) if sweep == "layout" else _device_sweep(tmp_path))
    parser = _Images()
    parser.feed(report.html.read_text())
    names = [img["alt"] for img in parser.images]
    assert names == list(report.plots) and len(names) == (5 if sweep == "layout" else 7)
    for img in parser.images:
        src = str(img["src"])
        assert src.startswith("data:image/png;base64,"), img["alt"]  # self-contained
        _loaded(base64.b64decode(src.split(",", 1)[1]), f"<img alt={img['alt']}>")
    for target in re.findall(r"\]\((plots/[^)]+)\)", report.markdown.read_text()):  # report.md's plots beside it
        _loaded((report.directory / target).read_bytes(), target)

    shot = tmp_path / f"report-{sweep}.png"
    command = [
        chromium,
        "--headless",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1400,2600",
        f"--screenshot={shot}",
        report.html.as_uri(),
    ]
    if os.geteuid() == 0:
        command.insert(1, "--no-sandbox")  # Chromium refuses to run its sandbox as root
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0 and shot.is_file(), proc.stdout[-2000:] + proc.stderr[-2000:]
    page = _loaded(shot.read_bytes(), "the screenshot")
    assert page.size == (1400, 2600)
    pixels = {colour: n for n, colour in page.getcolors(maxcolors=1 << 24)}
    bar = tuple(int(PALETTE[0][i : i + 2], 16) for i in (1, 3, 5))
    assert pixels.get(bar, 0) > 5000, "the plots' bars are not on the page"  # rendered, not broken-image icons
    assert (pixels.get((0xFF, 0xF3, 0xCD), 0) > 1000) == (sweep == "layout"), "the noise warning box"


def test_the_table_shows_each_jobs_goodput(tmp_path: Path) -> None:
    study = _device_sweep(tmp_path, goodput={"goodput": 0.875, "total_s": 100.0, "productive_s": 87.5})
    older = json.loads((study / "1" / "results.json").read_text())
    (study / "1" / "results.json").write_text(json.dumps({**older, "goodput": None}))  # a job from before goodput
    rows = _table(build_report(study).markdown.read_text())
    assert [(r["job"], r["goodput"]) for r in rows] == [
        ("#2 dp4-tp1-pp1", "87.5%"),
        ("#1 dp2-tp1-pp1", "–"),
        ("#0 dp1-tp1-pp1", "87.5%"),
    ]
