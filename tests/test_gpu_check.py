"""``benchmarks/gpu_check.py --smoke``: the one GPU script's code paths on the CPU (tiny GPT, eager and compiled,
and float8 emulated),
its summary keys, and ``lightning-scale-plan calibrate`` reading its JSON."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_benchmarks import ROOT, _bench

KEYS = {
    "device",
    "driver",
    "torch",
    "mfu_350m",
    "mfu_1.3b",
    "mfu_1.3b_fp8",
    "async_block_ratio",
    "planner_step_error",
    "planner_memory_error",
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: gpu_check.py measures it")
def test_without_cuda_and_without_smoke_it_says_so_and_exits_0(tmp_path: Path) -> None:
    assert _bench("gpu_check", "gpu_check.py", out=tmp_path / "none.json") == {"skipped": "no CUDA GPU"}
    script = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path / "again.json")]
    proc = subprocess.run(script, capture_output=True, text=True, timeout=300, env=dict(os.environ), check=True)
    assert "no CUDA GPU on this machine; nothing to measure (--smoke runs the same paths on the CPU)" in proc.stdout


@pytest.mark.slow
def test_the_smoke_run_reports_every_key_and_calibrates_the_planner(tmp_path: Path) -> None:
    from lightning_scale.cli.plan_calibrate import calibrate

    report = _bench("gpu_check", "gpu_check.py", "--smoke", out=tmp_path / "gpu_check-cpu-smoke.json")
    assert KEYS <= set(report)
    assert report["device"] == "cpu" and report["driver"] is None and report["torch"] == torch.__version__
    assert report["mfu_350m"] is None and report["mfu_1.3b"] is None and report["mfu_1.3b_fp8"] is None
    runs = report["runs"]
    assert [(r["preset"], r["compile"], r["float8"], r["calibrate"]) for r in runs] == [
        ("tiny", "eager", None, False),
        ("tiny", "compiled", None, True),
        ("tiny", "eager", "rowwise", True),  # float8 linears through torchao, emulated on the CPU
    ]
    assert all(r["status"] == "completed" and 0 < r["mfu"] < 1 and r["step_time"]["total"] > 0 for r in runs)
    assert report["mfu_tiny_compiled"] == runs[1]["mfu"] and report["compile_s_tiny"] is not None
    assert report["mfu_tiny_fp8"] == runs[2]["mfu"] and report["fp8_skipped"] is None
    assert report["fp8_tokens_per_sec_ratio"] == pytest.approx(runs[2]["tokens_per_sec"] / runs[1]["tokens_per_sec"])
    compiled = runs[1]
    assert 0 < compiled["async_save_blocking_s"] <= compiled["async_save_committed_s"]
    assert report["async_block_ratio"] == compiled["async_blocking_vs_sync"] > 0
    assert report["planner_step_error"] == pytest.approx(compiled["planner"]["step_time_error"])
    assert report["planner_memory_error"] is None  # no CUDA allocator to measure tensor memory on the CPU
    assert report["presets"]["tiny"] == compiled

    lines = calibrate([tmp_path / "gpu_check-cpu-smoke.json"], store=tmp_path / "calibration.json")
    assert any(re.search(r": 1 run\(s\); calibrated on 1 measured run", line) for line in lines), lines
    assert any("runs[0]: measured for comparison only (calibrate: false)" in line for line in lines), lines
    assert any(line.strip().startswith("tiny-compiled:dp1-tp1-pp1") for line in lines), lines
    # The CPU has no float8 peak: its emulated float8 run is no observation (on an H100 it fits float8_gemm).
    assert any("runs[2]: " in line and "no float8 peak" in line for line in lines), lines
