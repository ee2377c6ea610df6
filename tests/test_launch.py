"""Launching with torch's own launcher: two torchrun agents on loopback form one 4-process job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_scale.cli.environment import RESOLVED_CONFIG_ENV


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_agents_on_loopback_train_dp2_by_tp2(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", RESOLVED_CONFIG_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    overrides = [
        "trainer.num_nodes=2", "trainer.devices=2", "trainer.max_steps=6", "trainer.val_check_interval=6",
        "trainer.limit_val_batches=2", "strategy=hybrid", "strategy.data_parallel=2", "strategy.tensor_parallel=2",
        "data.seq_len=64", "data.global_batch_size=4", "callbacks=none", "logger=none",
    ]  # fmt: skip
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "lightning-scale-test",
             "-m", "lightning_scale.cli.train", *overrides],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=400)[0])
    finally:
        for agent in agents:
            agent.kill()
    for agent, out in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, out[-4000:]
    log = "\n".join(outputs)
    assert "HybridParallelStrategy: dp=2 x pp=1 x tp=2 (ddp) on 4 processes" in log, log[-4000:]
    # Every rank composed the config, yet the job has one run directory, rank 0's.
    run_dirs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs
    run_dir = run_dirs[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["global_step"] == 6
    assert (run_dir / "train.log").exists() and (run_dir / "train.rank3.log").exists()
    assert (run_dir / "resolved_config.yaml").exists() and (run_dir / ".hydra").is_dir()


def test_slurm_ranks_share_a_run_directory_named_by_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    # SLURM itself does not run here: its environment variables stand in for it.
    from lightning_scale.cli import environment

    for name in ("TORCHELASTIC_USE_AGENT_STORE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_PROCID", "5")
    environment.run_name.cache_clear()
    try:
        assert environment.launched_externally() and environment.global_rank() == 5
        assert environment.run_name() == "slurm-4242"
        assert environment.log_suffix() == ".rank5"
        monkeypatch.setenv("SLURM_NTASKS", "1")  # one task: Lightning's own launcher starts the rest
        environment.run_name.cache_clear()
        assert not environment.launched_externally() and environment.log_suffix() == ""
    finally:
        environment.run_name.cache_clear()
