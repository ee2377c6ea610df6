"""`lightning-scale-train` end to end, and its checks on bad input before any process starts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from lightning_scale.cli.train import RESOLVED_CONFIG_ENV, build, planned_data_parallel_size


def _executable() -> str:
    local = Path(sys.executable).parent / "lightning-scale-train"
    found = str(local) if local.exists() else shutil.which("lightning-scale-train")
    assert found, "lightning-scale-train is not installed (pip install -e .)"
    return found


def _train(*overrides: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", RESOLVED_CONFIG_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [_executable(), *overrides], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


@pytest.mark.slow
def test_default_run_trains_two_processes_and_the_loss_falls(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = _train(timeout=300)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # One run directory: the child process did not compose (and date) a run of its own.
    run_dirs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 300
    assert summary["num_parameters"] < 1_000_000
    # Byte-level text starts at ln(256) = 5.55; a working run ends far below it.
    assert summary["initial_val_loss"] > 5.0
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 2.0
    printed = [float(x) for x in re.findall(r"step \d+/300 \| train/loss ([\d.]+)", proc.stdout)]
    assert len(printed) == 15 and printed[-1] < printed[0]  # every 20 steps
    assert (run_dirs[0] / "checkpoints" / "last.ckpt").is_file()  # Lightning's DDPStrategy: one file
    assert (run_dirs[0] / "csv" / "metrics.csv").is_file()
    assert elapsed < 180, f"the quickstart must finish in under 3 minutes on 2 cores, took {elapsed:.0f} s"


def test_bad_value_fails_fast_from_the_command_line(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = _train("data.seq_len=512", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode != 0
    assert "data.seq_len=512 exceeds the model's context model.block_size=256" in proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr  # no process group, no child
    assert time.monotonic() - start < 60


def _cfg(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_module("lightning_scale.conf", version_base="1.3"):
        return compose("config", overrides=["run_dir=unused", *overrides])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["model.n_heads=5"], r"d_model=128 is not divisible by n_heads=5.*Use n_heads in \[1, 2, 4, 8, 16, 32, 64, 128\]"),
        (["data.path=/no/such/corpus.txt"], r"Data path '/no/such/corpus.txt' does not exist.*leave the path unset"),
        (["data.seq_len=512"], r"data.seq_len=512 exceeds the model's context model.block_size=256. Set data.seq_len<=256"),
        (["data.global_batch_size=1"], r"global_batch_size=1 is smaller than the number of data-parallel ranks \(2\)"),
        (["data.global_batch_size=3"], r"global_batch_size=3 does not split evenly over 2 data-parallel ranks"),
        (["model.vocab_size=100"], r"token ids up to 255 but model.vocab_size=100. Set model.vocab_size>=256"),
        (["ckpt_path=last"], r"ckpt_path='last' points to unused/checkpoints/last.ckpt, which does not exist"),
        (["trainer.devices=0"], r"trainer.devices=0 is not a positive count"),
        (
            ["strategy=hybrid", "strategy.data_parallel=2", "strategy.tensor_parallel=2"],
            r"data_parallel=2 x pipeline_parallel=1 x tensor_parallel=2 = 4 processes, but this run has 2",
        ),
    ],
)
def test_bad_input_is_a_value_error_before_any_process_starts(overrides: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build(_cfg(*overrides))
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], 2),
        (["trainer.devices=[0,1,2]"], 3),
        (["trainer.devices='4'"], 4),
        (["trainer.devices=2", "trainer.num_nodes=3"], 6),
        (["trainer.devices=1"], 1),
        (["strategy=tensor_parallel", "trainer.devices=4", "trainer.num_nodes=2"], 2),
        (["strategy=hybrid", "trainer.devices=4", "strategy.tensor_parallel=2"], 2),
    ],
)
def test_planned_data_parallel_size(overrides: list[str], expected: int) -> None:
    assert planned_data_parallel_size(_cfg(*overrides)) == expected


def _short_run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """10 steps on 2 processes, no checkpoints or loggers, into tmp_path/run."""
    fixed = ["trainer.max_steps=10", "trainer.limit_val_batches=2", "callbacks=none", "logger=none"]
    return _train(*overrides, *fixed, f"hydra.run.dir={tmp_path / 'run'}", timeout=300)


@pytest.mark.slow
def test_tensor_parallel_strategy_from_the_command_line(tmp_path: Path) -> None:
    proc = _short_run(tmp_path, "strategy=tensor_parallel")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "HybridParallelStrategy: dp=1 x pp=1 x tp=2 on 2 processes" in proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final_val_loss"] < summary["initial_val_loss"]


@pytest.mark.slow
def test_pipeline_strategy_with_a_cost_balanced_partition_from_the_command_line(tmp_path: Path) -> None:
    # The command as a user types it. The CLI validates before it fits: the blocks are timed on a
    # validation batch (the datamodule has no training split yet), and the cut made then serves the fit.
    proc = _train(
        "strategy=pipeline", "strategy.partition=by_cost", "trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'run'}",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "HybridParallelStrategy: dp=1 x pp=2 x tp=1 on 2 processes" in out
    assert re.search(
        r"Pipeline: 2 stages on 2 ranks \(1 per rank\), partition by_cost, blocks per stage \[\d, \d\], stage costs "
        r"\[[\d.]+, [\d.]+\] s, predicted bubble 20.0% \(1f1b, 4 micro-batches\)",
        out,
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["global_step"] == 3 and summary["final_val_loss"] < summary["initial_val_loss"] - 0.5  # 5.5 -> 4.3
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_dir()
