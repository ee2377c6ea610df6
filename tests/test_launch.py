"""Launching with torch's own launcher: two torchrun agents on loopback form one 4-process job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
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
        "trainer.num_nodes=2",
        "trainer.devices=2",
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        "trainer.limit_val_batches=2",
        "strategy=hybrid",
        "strategy.data_parallel=2",
        "strategy.tensor_parallel=2",
        "data.seq_len=64",
        "data.global_batch_size=4",
        "callbacks=none",
        "logger=none",
    ]
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "lightning-scale-test",
                "-m",
                "lightning_scale.cli.train",
                *overrides,
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
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


def test_torchrun_ranks_and_restarts_share_one_run_directory_per_run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from lightning_scale.cli import environment
    from lightning_scale.cli.resolvers import launched

    for name in ("SLURM_JOB_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # torchrun's agent store
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
        "TORCHELASTIC_RUN_ID": "job-7",
        "RANK": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "GROUP_WORLD_SIZE": "3",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "6",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        environment.run_name.cache_clear()
        first = environment.run_name()  # the first attempt's rank 0 names it by its start time
        assert environment.launched_externally() and len(first) == len("2026-11-30/06-31-02"), first
        assert (launched("num_nodes", 1), launched("devices", 2)) == (3, 2)  # this attempt's, not the defaults
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
        monkeypatch.setenv("RANK", "1")
        environment.run_name.cache_clear()
        time.sleep(1.1)  # a restart seconds later, on another rank: the same directory
        assert environment.run_name() == first
        # Without the shared store (an elastic launch) the run id names it: no rank needs another to agree.
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
        environment.run_name.cache_clear()
        assert environment.run_name() == "torchrun-job-7"
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id
        environment.run_name.cache_clear()
        with pytest.raises(
            ValueError,
            match=r"TORCHELASTIC_RUN_ID='none' \(no --rdzv-id\) and without its shared agent "
            r"store .* Pass torchrun --rdzv-id=<a name for this run> .* or hydra.run.dir=",
        ):
            environment.run_name()
        with pytest.raises(
            ValueError, match=r"\$\{ls_launched:nodes,...\}: the first argument must be one of num_nodes, devices"
        ):
            launched("nodes", 1)
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # Lightning's own launcher: no run id, the defaults
        assert not environment.launched_externally() and (launched("num_nodes", 1), launched("devices", 2)) == (1, 2)
    finally:
        environment.run_name.cache_clear()
