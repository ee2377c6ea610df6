"""Benchmarks are not tests, but each must still run: a tiny smoke run checks the output format."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_tensor_parallel_benchmark_prints_its_ratios(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tensor_parallel.py"), "--layers", "1", "--d-model", "64",
         "--seq", "32", "--steps", "2", "--warmup", "1", "--rounds", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"BENCH tensor_parallel (\{.*\})", line)
    assert match, line
    report = json.loads(match.group(1))
    assert report == json.loads(out.read_text())
    for key in ("ratio_vs_raw_torch", "fraction_of_bound", "speedup_vs_tp1", "comm_s_per_step"):
        assert report[key] > 0, key


@pytest.mark.slow
def test_pipeline_benchmark_prints_its_ratios(tmp_path: Path) -> None:
    out = tmp_path / "pp.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--layers", "2", "--d-model", "64", "--seq", "32",
         "--steps", "2", "--warmup", "1", "--rounds", "1", "--microbatches", "2,4", "--no-deepspeed", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"BENCH pipeline (\{.*\})", line)
    assert match, line
    report = json.loads(match.group(1))
    assert report == json.loads(out.read_text())
    assert [r["microbatches"] for r in report["results"]] == [2, 4]
    for key in ("fraction_of_bound", "ratio_vs_raw_torch"):
        assert report[key] > 0, key
    # The three implementations train the same model on the same batch.
    assert report["results"][0]["first_loss"]["strategy"] == pytest.approx(report["results"][0]["first_loss"]["raw_torch"])
    assert report["deepspeed_error"] == "skipped (--no-deepspeed)" and report["ratio_vs_deepspeed"] is None
