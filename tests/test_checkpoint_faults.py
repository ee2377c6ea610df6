"""Crashes: workers SIGKILLed at random moments (some in the middle of a save) under
``torchrun --max-restarts``; every relaunch resumes from the newest checkpoint that verifies on its
own, and the run ends bitwise where an uninterrupted one does."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed import run_distributed

from lightning_scale.plugins.checkpoint_io import load_full_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "elastic_run.py"
STEPS = 48  # enough that 4 kills, each after 1-3 new checkpoints (every 2 steps), all land before the run ends


def _torchrun(out: Path, layout: str, restarts: int) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.1",
        str(SCRIPT),
        str(out),
        layout,
        str(STEPS),
    ]
    return subprocess.Popen(command, env=env, stdout=open(out / "log.txt", "w"), stderr=subprocess.STDOUT)


def _pids(out: Path, restart: int, deadline: float, proc: subprocess.Popen) -> list[int] | None:
    """Both workers' pids of launch ``restart`` once they train (None: the run ended or time ran out)."""
    while time.monotonic() < deadline and proc.poll() is None:
        files = [out / "pids" / f"{restart}-{rank}" for rank in (0, 1)]
        if all(f.is_file() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.02)
    return None


def _saving(out: Path) -> bool:
    ckpt = out / "ckpt"
    try:
        return ckpt.is_dir() and any(".staging-" in p.name for p in ckpt.iterdir())
    except FileNotFoundError:  # a directory renamed while listing
        return True


def _committed(out: Path) -> set[str]:
    ckpt = out / "ckpt"
    try:
        return {p.name for p in ckpt.iterdir() if (p / "manifest.json").is_file()} if ckpt.is_dir() else set()
    except FileNotFoundError:
        return set()


def _uninterrupted(rank: int, world: int, out: str, layout: str) -> None:
    """The reference: the same script's training on ranks forked from the test harness (no torchrun
    start-up and imports to pay for); it saves nothing, so saving must not change training either."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("elastic_run", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(Path(out), layout, STEPS, checkpoints=False)


def _run_with_kills(out: Path, layout: str, kills: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    proc = _torchrun(out, layout, restarts=kills + 2)
    deadline = time.monotonic() + 600
    killed: list[dict[str, Any]] = []
    try:
        for restart in range(kills):
            pids = _pids(out, restart, deadline, proc)
            if pids is None:
                break
            # Let this launch commit 1-3 new checkpoints, so the run makes progress between kills.
            seen, wanted = _committed(out), rng.randint(1, 3)
            while len(_committed(out) - seen) < wanted and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.005)
            if restart % 2 == 1:  # every other kill lands while a checkpoint is being written
                while not _saving(out) and time.monotonic() < deadline and proc.poll() is None:
                    time.sleep(0.001)
            else:
                time.sleep(rng.uniform(0.0, 0.3))
            victim = rng.choice(pids)
            during_save = _saving(out)
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append({"restart": restart, "pid": victim, "during_save": during_save})
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    journal = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    return {"code": code, "killed": killed, "journal": journal, "log": (out / "log.txt").read_text()[-4000:]}


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "kills"), [("dp2", 4), ("pp2", 4)])
def test_sigkilled_workers_relaunch_resume_from_latest_and_end_bitwise_like_an_uninterrupted_run(
    tmp_path: Path, layout: str, kills: int
) -> None:
    (tmp_path / "straight").mkdir()
    run_distributed(_uninterrupted, 2, str(tmp_path / "straight"), layout, timeout=300)
    run = _run_with_kills(tmp_path / "killed", layout, kills=kills, seed=1)
    assert run["code"] == 0, run["log"]
    assert len(run["killed"]) == kills, run["killed"]
    assert any(k["during_save"] for k in run["killed"]), run["killed"]  # some kills tore a save

    starts = {}
    for record in run["journal"]:
        starts.setdefault(record["restart"], []).append(record)
    assert sorted(starts) == list(range(kills + 1)), sorted(starts)
    for restart, records in starts.items():
        steps = {r["start_step"] for r in records}
        assert len(steps) == 1, records  # every rank resumed the same checkpoint
        for r in records:
            if r["resumed_from"] is not None:
                # Only committed checkpoints (they verified on load) are resumed: never a staging directory.
                assert ".staging-" not in r["resumed_from"] and r["resumed_step"] == r["start_step"], r
            else:
                assert r["start_step"] == 0, r
    assert max(r["start_step"] for r in run["journal"]) > 0  # relaunches did resume, on their own

    final, reference = (
        load_full_checkpoint(tmp_path / "killed" / "final"),
        load_full_checkpoint(tmp_path / "straight" / "final"),
    )
    assert final["global_step"] == reference["global_step"] == STEPS
    for name, value in reference["state_dict"].items():
        assert torch.equal(final["state_dict"][name], value), name
    for fqn, entries in reference["optimizer_states"][0]["state"].items():
        for key, value in entries.items():
            assert torch.equal(final["optimizer_states"][0]["state"][fqn][key], value), (fqn, key)
    shutil.rmtree(tmp_path, ignore_errors=True)
