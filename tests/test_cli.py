"""`lightning-scale-train` end to end, and its checks on bad input before any process starts."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from lightning_scale.callbacks import PreemptionCheckpoint
from lightning_scale.cli.environment import RESOLVED_CONFIG_ENV
from lightning_scale.cli.job_config import planned_data_parallel_size
from lightning_scale.cli.resume import resumable_checkpoint, resume_checkpoint
from lightning_scale.cli.run import build
from lightning_scale.core.checkpoint.format import CheckpointCorruptError, verify
from lightning_scale.core.checkpoint.sharded import save_sharded
from lightning_scale.plugins import PREEMPTION_EXIT_CODE, MixedPrecision, ShardedCheckpointIO
from lightning_scale.plugins.checkpoint_io import load_full_checkpoint
from lightning_scale.strategies import HybridParallelStrategy


def _executable() -> str:
    local = Path(sys.executable).parent / "lightning-scale-train"
    found = str(local) if local.exists() else shutil.which("lightning-scale-train")
    assert found, "lightning-scale-train is not installed (pip install -e .)"
    return found


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", RESOLVED_CONFIG_ENV)}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _train(
    *overrides: str, timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_executable(), *overrides],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or _env(),
        cwd=cwd,
        check=False,
    )


def _train_until(
    line: str, sig: signal.Signals, *overrides: str, timeout: float = 400, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Start a run, send ``sig`` once it prints ``line`` (SIGKILL to every process of the run, as a
    lost machine; SIGTERM to the first process only, as Kubernetes or a cloud's spot notice does),
    then wait; returns (exit status, output). A run still going after ``timeout`` is killed."""
    proc = subprocess.Popen(
        [_executable(), *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or _env(),
        start_new_session=True,  # its own process group, so SIGKILL reaches the ranks it starts
    )
    watchdog = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    watchdog.start()
    out, sent = [], False
    try:
        assert proc.stdout is not None
        for text in proc.stdout:
            out.append(text)
            if not sent and line in text:
                sent = True
                os.killpg(proc.pid, sig) if sig == signal.SIGKILL else os.kill(proc.pid, sig)
        return proc.wait(), "".join(out)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass
class _Run:
    proc: subprocess.CompletedProcess[str]
    elapsed_s: float
    run_dir: Path
    step_200: Path | None
    """A copy of the run's checkpoint at step 200, taken while it ran (ModelCheckpoint keeps only the
    newest, so it is gone at step 300); None if the copy was missed."""


def _copy_when_committed(
    pattern: str, cwd: Path, into: Path, proc: subprocess.Popen[str], deadline: float
) -> Path | None:
    """While ``proc`` runs (until ``deadline``), copy the first checkpoint under ``cwd`` matching ``pattern``
    once committed (renamed into place from its hidden staging directory) into ``into``; returns the
    copy, or None if none was copied whole."""
    while proc.poll() is None and time.monotonic() < deadline:
        for found in cwd.glob(pattern):
            if (found / "manifest.json").is_file():
                try:
                    copy = Path(shutil.copytree(found, into / found.name))
                    verify(copy)
                    return copy
                except (OSError, shutil.Error, CheckpointCorruptError):  # deleted while copied: the run went past it
                    return None
        time.sleep(0.05)
    return None


def _readme_env(data_cache: Path) -> dict[str, str]:
    """The environment the README runs its main job in: nothing set that the README does not set (the data
    cache aside, which every test shares); OMP_NUM_THREADS above all, which the other tests export."""
    env = _env(LIGHTNING_SCALE_CACHE=str(data_cache))
    del env["OMP_NUM_THREADS"]
    return env


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> _Run:
    """The README's main job exactly as a user types it, `lightning-scale-train` with no arguments,
    run once: the quickstart test checks it, and the resume test takes it as the uninterrupted run
    (and its checkpoint at step 200 as where a run of the same config is after 200 steps)."""
    cwd = tmp_path_factory.mktemp("quickstart")
    logs = tmp_path_factory.mktemp("quickstart_logs")
    start = time.monotonic()
    # The cache the per-test fixture sets, which a module fixture runs before.
    with open(logs / "stdout", "w") as out, open(logs / "stderr", "w") as err:
        popen = subprocess.Popen(
            [_executable()], stdout=out, stderr=err, text=True, cwd=cwd, env=_readme_env(data_cache)
        )
        try:
            step_200 = _copy_when_committed(
                "outputs/*/*/checkpoints/epoch=*-step=200.ckpt", cwd, logs, popen, start + 300
            )
            popen.wait(timeout=max(start + 300 - time.monotonic(), 1))
        finally:
            if popen.poll() is None:
                popen.kill()
                popen.wait()
    elapsed = time.monotonic() - start
    proc = subprocess.CompletedProcess(
        popen.args, popen.returncode, (logs / "stdout").read_text(), (logs / "stderr").read_text()
    )
    run_dirs = [p for p in (cwd / "outputs").glob("*/*") if p.is_dir()]
    # One run directory: the child process did not compose (and date) a run of its own.
    assert len(run_dirs) == 1, (run_dirs, proc.stdout[-3000:] + proc.stderr[-3000:])
    return _Run(proc, elapsed, run_dirs[0], step_200)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # load_full_checkpoint: one process, as meant
def test_default_run_trains_two_processes_and_the_loss_falls(quickstart: _Run) -> None:
    proc, run_dir = quickstart.proc, quickstart.run_dir
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The package's own strategy, data parallel over the two processes.
    assert "HybridParallelStrategy: dp=2 x pp=1 x tp=1 (ddp) on 2 processes" in proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 300
    assert summary["num_parameters"] < 1_000_000
    # The README's figures: byte-level text starts at ln(256) = 5.55; "falls from about 5.5 to about 2.4".
    assert summary["initial_val_loss"] == pytest.approx(5.5, abs=0.1)
    assert summary["final_val_loss"] == pytest.approx(2.4, abs=0.15)
    printed = [float(x) for x in re.findall(r"step \d+/300 \| train/loss ([\d.]+)", proc.stdout)]
    assert len(printed) == 15  # every 20 steps
    assert printed[0] == pytest.approx(3.3, abs=0.2) and printed[-1] == pytest.approx(2.4, abs=0.15)
    last = run_dir / "checkpoints" / "last.ckpt"
    verify(last)  # a sharded checkpoint directory (ShardedCheckpointIO), committed, every file as listed
    # Hyper-parameters as plain values (Hydra's ListConfig would be kept as its repr).
    assert load_full_checkpoint(last)["hyper_parameters"]["betas"] == (0.9, 0.95)
    assert (run_dir / "csv" / "metrics.csv").is_file()
    # train.log holds what the console showed: the package's lines and Lightning's messages.
    log = (run_dir / "train.log").read_text()
    for line in (
        "lightning-scale-train: ",
        "step 300/300 | train/loss",
        "HybridParallelStrategy: dp=2",
        "`Trainer.fit` stopped",
        "summary: ",
    ):
        assert line in log, line
    # Where its wall time went (GoodputMonitor, on by default): one attempt, the parts adding up to the whole.
    goodput = summary["goodput"]
    assert (goodput["attempts"], goodput["interruptions"], goodput["lost_s"]) == (1, 0, 0.0)
    assert 0 < goodput["goodput"] < 1 and abs(goodput["unaccounted_s"]) < 1e-6
    assert json.loads((run_dir / "results.json").read_text())["goodput"] == goodput
    assert quickstart.elapsed_s < 180, (
        f"the quickstart must finish in under 3 minutes on 2 cores, took {quickstart.elapsed_s:.0f} s"
    )


@pytest.mark.slow
def test_the_quickstart_prints_no_warning_the_package_could_prevent(quickstart: _Run) -> None:
    """A newcomer's console is the package's lines and Lightning's, with no warning, deprecation notice or
    advertisement (issue 39: torch's `reduce_op` FutureWarning at exit, Lightning's litlogger tip, the
    cost callback's warning that a CPU has no price); and each process ran its share of the cores."""
    proc = quickstart.proc
    noise = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if re.search(r"warn|deprecat|💡|\btip\b|litlogger", line, re.IGNORECASE)
    ]
    assert not noise, "\n".join(noise)
    results = json.loads((quickstart.run_dir / "results.json").read_text())
    assert results["threads_per_process"] == max(1, len(os.sched_getaffinity(0)) // 2)


@pytest.mark.slow
def test_default_run_killed_then_preempted_resumes_to_the_uninterrupted_result(
    quickstart: _Run, tmp_path: Path, data_cache: Path
) -> None:
    """The default config (checkpoints every 100 steps) lost at step 220 with SIGKILL, resumed with
    ckpt_path=latest, preempted with SIGTERM at step 260, resumed again: the final validation loss is
    the uninterrupted run's (the quickstart's), bit for bit.

    The first 200 steps are the quickstart's, not run again: its checkpoint at step 200 and its CSV
    log (all 300 steps: each start must keep only the rows before the step it resumes from) are
    copied into this run's directory, and the first attempt resumes from there."""
    assert (quickstart.run_dir / "summary.json").is_file(), "the uninterrupted run failed"
    assert quickstart.step_200 is not None, "the quickstart's checkpoint at step 200 was not copied while it ran"
    assert verify(quickstart.step_200)["global_step"] == 200
    run_dir = tmp_path / "run"
    copied = Path(shutil.copytree(quickstart.step_200, run_dir / "checkpoints" / quickstart.step_200.name))
    (run_dir / "csv").mkdir()
    shutil.copy(quickstart.run_dir / "csv" / "metrics.csv", run_dir / "csv" / "metrics.csv")
    here = f"hydra.run.dir={run_dir}"
    env = _readme_env(data_cache)  # the quickstart's threads per process, for results equal bit for bit
    status, out = _train_until("step 220/300", signal.SIGKILL, here, "ckpt_path=latest", env=env)
    assert status == -signal.SIGKILL, out[-3000:]
    assert f"Restored all states from the checkpoint at {copied}" in out, out[-3000:]
    assert not list((run_dir / "checkpoints").glob("step-*"))  # a crash leaves no checkpoint of its own

    status, out = _train_until("step 260/300", signal.SIGTERM, here, "ckpt_path=latest", env=env)
    assert status == PREEMPTION_EXIT_CODE, out[-3000:]
    assert "still ran at exit" not in out, out[-3000:]  # the preempted ranks' groups ended with the run
    restored = re.search(r"Restored all states from the checkpoint at (\S+)", out)
    assert restored and verify(Path(restored[1]))["global_step"] == 200, out[-3000:]  # the newest before the crash
    (preempted,) = (run_dir / "checkpoints").glob("step-*")  # committed at the step the signal stopped
    assert verify(preempted)["global_step"] == int(preempted.name.removeprefix("step-")) >= 260

    proc = _train(here, "ckpt_path=latest", timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"Restored all states from the checkpoint at {preempted}" in proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    reference = json.loads((quickstart.run_dir / "summary.json").read_text())
    assert summary["global_step"] == 300
    assert summary["final_val_loss"] == reference["final_val_loss"]
    # The CSV log holds the whole run, each logged step once: the attempts' rows up to each resume point,
    # then the next attempt's (Lightning's writer had deleted the file at each start). The step the
    # preemption stopped at has no row: the checkpoint is committed and the process ends before
    # Lightning logs that step's metrics.
    import csv

    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        train_steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
    stopped = int(preempted.name.removeprefix("step-")) - 1  # Lightning's row index of that step
    assert train_steps == [s for s in range(9, 300, 10) if s != stopped], train_steps
    # The goodput across the three attempts: the 20 steps after step 200 recomputed, the preemption none.
    goodput = summary["goodput"]
    assert (goodput["attempts"], goodput["interruptions"], goodput["hangs"]) == (3, 2, 0)
    assert goodput["lost_s"] > 0 and goodput["mttr_s"] > 0 and abs(goodput["unaccounted_s"]) < 1e-6


def test_bad_value_fails_fast_from_the_command_line(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = _train("data.seq_len=512", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode != 0
    assert "data.seq_len=512 exceeds the model's context model.block_size=256" in proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr  # no process group, no child
    assert time.monotonic() - start < 60


def _cfg(*overrides: str, run_dir: str | Path = "unused"):
    GlobalHydra.instance().clear()
    with initialize_config_module("lightning_scale.conf", version_base="1.3"):
        return compose("config", overrides=[f"run_dir={run_dir}", *overrides])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["model.n_heads=5"],
            r"d_model=128 is not divisible by n_heads=5.*Use n_heads in \[1, 2, 4, 8, 16, 32, 64, 128\]",
        ),
        (["data.path=/no/such/corpus.txt"], r"Data path '/no/such/corpus.txt' does not exist.*leave the path unset"),
        (
            ["data.seq_len=512"],
            r"data.seq_len=512 exceeds the model's context model.block_size=256. Set data.seq_len<=256",
        ),
        (["data.global_batch_size=1"], r"global_batch_size=1 is smaller than the number of data-parallel ranks \(2\)"),
        (["data.global_batch_size=3"], r"global_batch_size=3 does not split evenly over 2 data-parallel ranks"),
        (["model.vocab_size=100"], r"token ids up to 255 but model.vocab_size=100. Set model.vocab_size>=256"),
        (["ckpt_path=last"], r"ckpt_path='last' points to unused/checkpoints/last.ckpt, which does not exist"),
        (["trainer.devices=0"], r"trainer.devices=0 is not a positive count"),
        (
            ["strategy=deepspeed_zero2", "ckpt_path=latest"],
            r"ckpt_path='latest' picks the newest checkpoint.*DeepSpeed writes checkpoint directories of its own format.*"
            r"pass ckpt_path=last or the checkpoint directory itself; strategy=hybrid",
        ),
        (
            ["strategy=hybrid", "strategy.data_parallel=2", "strategy.tensor_parallel=2"],
            r"data_parallel=2 x pipeline_parallel=1 x tensor_parallel=2 = 4 processes, but this run has 2",
        ),
        (
            ["strategy=hybrid", "strategy.data_parallel_sync={mode: streaming_diloco, every: 16, fragments: 9}"],
            r"streaming_diloco\(fragments=9\) needs at least one block per fragment but the model has n_layers=\d+ "
            r"blocks. Use fragments<=\d+",
        ),
        (
            ["strategy=hybrid", "strategy.data_parallel_sync=diloco", "strategy.sync_every=0"],
            r"sync_every=0 must be a positive integer",
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
    """3 steps on 2 processes, no checkpoints or loggers, into tmp_path/run."""
    fixed = ["trainer.max_steps=3", "trainer.limit_val_batches=2", "callbacks=none", "logger=none"]
    return _train(*overrides, *fixed, f"hydra.run.dir={tmp_path / 'run'}", timeout=300)


@pytest.mark.slow
def test_tensor_parallel_strategy_from_the_command_line(tmp_path: Path) -> None:
    proc = _short_run(tmp_path, "strategy=tensor_parallel")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "HybridParallelStrategy: dp=1 x pp=1 x tp=2 on 2 processes" in proc.stdout + proc.stderr
    # Every rank joined its process groups' threads before exit (where one aborted a finished run).
    assert "still ran at exit" not in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final_val_loss"] < summary["initial_val_loss"]


@pytest.mark.slow
def test_pipeline_strategy_with_a_cost_balanced_partition_from_the_command_line(tmp_path: Path) -> None:
    # The command as a user types it. The CLI validates before it fits: the blocks are timed on a
    # validation batch (the datamodule has no training split yet), and the cut made then serves the fit.
    proc = _train(
        "strategy=pipeline",
        "strategy.partition=by_cost",
        "trainer.max_steps=3",
        f"hydra.run.dir={tmp_path / 'run'}",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "HybridParallelStrategy: dp=1 x pp=2 x tp=1 on 2 processes" in out
    assert "still ran at exit" not in proc.stderr  # the stages' groups joined too
    assert re.search(
        r"Pipeline: 2 stages on 2 ranks \(1 per rank\), partition by_cost, blocks per stage \[\d, \d\], stage costs "
        r"\[[\d.]+, [\d.]+\] s, predicted bubble 20.0% \(1f1b, 4 micro-batches\)",
        out,
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["global_step"] == 3 and summary["final_val_loss"] < summary["initial_val_loss"] - 0.5  # 5.5 -> 4.3
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_dir()


def test_the_main_job_runs_on_the_package_and_lightning_ddp_stays_for_comparison() -> None:
    module, _, trainer, _ = build(_cfg())
    strategy = trainer.strategy
    assert isinstance(strategy, HybridParallelStrategy) and isinstance(strategy.checkpoint_io, ShardedCheckpointIO)
    assert (
        isinstance(trainer.precision_plugin, MixedPrecision) and strategy.precision_plugin is trainer.precision_plugin
    )
    # Hydra's lists reach the module as plain values: its checkpoints load with weights_only=True.
    buffer = io.BytesIO()
    torch.save(dict(module.hparams), buffer)
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)["betas"] == (0.9, 0.95)

    _, _, trainer, _ = build(_cfg("strategy=ddp"))
    assert type(trainer.strategy).__name__ == "DDPStrategy" and isinstance(trainer.precision_plugin, MixedPrecision)
    # HybridParallelStrategy adds its own; under Lightning's strategies the CLI does.
    assert sum(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks) == 1
    assert not dist.is_initialized()


def test_latest_is_one_rule_in_the_format_the_runs_strategy_loads(tmp_path: Path) -> None:
    # ckpt_path=latest under ddp and a sweep resuming a job go through lightning_scale.core.checkpoint.latest:
    # by step (not modification time), verified, in the format the strategy loads.
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    root.mkdir(parents=True)
    full = {"optimizer_states": [{}], "loops": {}, "state_dict": {"w": torch.zeros(4)}}
    torch.save({**full, "global_step": 5}, root / "epoch=0-step=5.ckpt")
    torch.save({**full, "global_step": 8}, root / "step-000008.ckpt")
    (root / "last.ckpt").symlink_to("step-000008.ckpt")
    torch.save({"global_step": 12, "state_dict": {"w": torch.zeros(4)}}, root / "weights-step=12.ckpt")
    written = io.BytesIO()
    torch.save({**full, "global_step": 20}, written)
    (root / "step-000020.ckpt").write_bytes(written.getvalue()[:200])  # a save killed half way
    (root / "copied-back.ckpt").write_bytes((root / "epoch=0-step=5.ckpt").read_bytes())  # the newest file, step 5
    sharded = save_sharded(
        root / "step-000003", {"w": torch.zeros(4)}, metadata={"global_step": 3, "wandb_run_id": "w1"}, token="t"
    )
    ddp = _cfg("strategy=ddp", "ckpt_path=latest", run_dir=run_dir)
    with pytest.warns(RuntimeWarning, match=r"step-000020\.ckpt does not load"):
        assert resume_checkpoint(ddp) == str(root / "step-000008.ckpt")
    with pytest.warns(RuntimeWarning):
        assert resumable_checkpoint(_cfg("strategy=ddp", run_dir=run_dir)) == (str(root / "step-000008.ckpt"), None)
    assert resumable_checkpoint(_cfg(run_dir=run_dir)) == (str(sharded), "w1")  # hybrid: its sharded directories
    assert resumable_checkpoint(_cfg(run_dir=tmp_path / "new")) == (None, None)


@pytest.mark.slow
def test_ddp_preemption_then_latest_and_last_resume(tmp_path: Path) -> None:
    """Under Lightning's own DDPStrategy and checkpoint format: SIGTERM commits a .ckpt at the step and
    exits with PREEMPTION_EXIT_CODE; ckpt_path=latest resumes from it; ckpt_path=last names a file that
    loads as Lightning loads it (weights_only=True)."""
    run_dir = tmp_path / "run"
    common = [
        "strategy=ddp",
        "trainer.limit_val_batches=2",
        "callbacks.checkpoint.every_n_train_steps=10",
        "logger=none",
        f"hydra.run.dir={run_dir}",
    ]
    status, out = _train_until("step 20/1000", signal.SIGTERM, *common, "trainer.max_steps=1000")
    assert status == PREEMPTION_EXIT_CODE, out[-3000:]
    (preempted,) = (run_dir / "checkpoints").glob("step-*.ckpt")
    state = torch.load(preempted, weights_only=True)
    step = state["global_step"]
    assert (
        preempted.name == f"step-{step:06d}.ckpt" and step >= 20 and state["hyper_parameters"]["betas"] == (0.9, 0.95)
    )

    last = run_dir / "checkpoints" / "last.ckpt"
    assert resume_checkpoint(_cfg("strategy=ddp", "ckpt_path=last", run_dir=run_dir)) == str(last)
    last_step = torch.load(last, weights_only=True)["global_step"]
    assert last_step in (step - step % 10, step - 10)  # ModelCheckpoint's, every 10 steps (none at a preempted step)
    assert resume_checkpoint(_cfg("strategy=ddp", "ckpt_path=latest", run_dir=run_dir)) == str(preempted)

    proc = _train(*common, "ckpt_path=latest", f"trainer.max_steps={step + 2}", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"Restored all states from the checkpoint at {preempted}" in proc.stdout + proc.stderr
    assert json.loads((run_dir / "summary.json").read_text())["global_step"] == step + 2
