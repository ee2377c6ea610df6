"""The hang watchdog (issue 27): a stalled training step makes every rank write its stacks, a summary
names the ranks that never reached the collective the others wait in, and every process exits with
``HANG_EXIT_CODE``; a normal run never triggers it; a relaunch under torchrun resumes and completes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import DistributedTestError, run_distributed
from helpers.lightning import quiet_trainer
from helpers.models import StackModule
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale.callbacks import HangWatchdog
from lightning_scale.core.resilience.hang_report import PHASES, laggards, summary_text
from lightning_scale.core.resilience.watchdog import HangTimeout, StepWatchdog, hang_timeout_policy
from lightning_scale.plugins import HANG_EXIT_CODE, PREEMPTION_EXIT_CODE
from lightning_scale.strategies import HybridParallelStrategy

ROOT = Path(__file__).resolve().parents[1]
FLOOR_S = 3.0  # the multi-process tests' limit per step (their steps take milliseconds)
STALL_AT = 4  # rank 1 stalls in this batch: past the warm-up steps


# ---------------------------------------------------------------- the limit and the option


def test_the_limit_is_a_multiple_of_the_recent_median_with_a_floor_and_a_warm_up_allowance() -> None:
    policy = HangTimeout(floor_s=10.0, multiple=5.0, warmup_s=100.0, warmup_steps=2)
    assert policy.limit(0, []) == 100.0  # the first steps: compilation, warm-up
    assert policy.limit(2, []) == 10.0
    assert policy.limit(5, [1.0, 3.0, 2.0]) == 10.0  # 5 x 2 s is the floor
    assert policy.limit(5, [4.0, 3.0, 9.0]) == 20.0  # 5 x the median, 4 s
    assert policy.limit(1, [40.0]) == 200.0  # the allowance is a minimum, not a cap
    fixed = hang_timeout_policy(7)
    assert fixed is not None and fixed.limit(0, []) == fixed.limit(9, [100.0]) == 7.0


def test_hang_timeout_values_and_the_errors_that_name_the_fix() -> None:
    assert hang_timeout_policy("auto") == hang_timeout_policy(None) == hang_timeout_policy(True) == HangTimeout()
    assert hang_timeout_policy(0) is None and hang_timeout_policy(False) is None
    assert hang_timeout_policy({"floor_s": 3, "multiple": 2}) == HangTimeout(floor_s=3, multiple=2)
    assert HangTimeout().floor_s == 120.0 and HangTimeout().warmup_s == 600.0
    fix = r"Pass 'auto' .* or 0/False to turn the watchdog off"
    for bad, rule in [
        (-5, r"hang_timeout=-5 must be a positive finite number of seconds"),
        (float("inf"), r"hang_timeout=inf must be a positive finite number"),
        ("soon", r"hang_timeout='soon' is not a timeout"),
        ({"floor": 3}, r"has unknown keys \['floor'\]"),
        ({"floor_s": 0}, r"floor_s=0 must be a positive number of seconds"),
        ({"multiple": -1}, r"multiple=-1 must be a finite number of 0 or more"),
        ({"warmup_steps": 1.5}, r"warmup_steps=1.5 must be an integer of 0 or more"),
    ]:
        with pytest.raises(ValueError, match=f"{rule}.*{fix}"):
            hang_timeout_policy(bad)
    # The strategy checks it when built, before any process starts.
    with pytest.raises(ValueError, match=r"hang_timeout='soon' is not a timeout"):
        HybridParallelStrategy(hang_timeout="soon")
    with pytest.raises(ValueError, match=r"hang_timeout=-1 must be a positive finite number of seconds"):
        HangWatchdog(-1)
    assert HybridParallelStrategy(hang_timeout=0).options.hang_timeout == 0
    assert HANG_EXIT_CODE == 75 and HANG_EXIT_CODE != PREEMPTION_EXIT_CODE


# ---------------------------------------------------------------- the summary


def _record(batch: int, phase: str, **extra: Any) -> dict[str, Any]:
    return {"batch": batch, "global_step": batch - 1, "phase": phase, "phase_s": 4.0, "host": "h", "pid": 1} | extra


def test_the_laggards_are_the_ranks_behind_the_others_or_without_a_record() -> None:
    records = {0: _record(5, "backward"), 1: _record(5, "forward"), 2: _record(5, "backward")}
    behind = laggards(records, 4)
    assert sorted(behind) == [1, 3]
    assert "forward of batch 5 (global step 4)" in behind[1] and "rank(s) 0, 2 reached backward" in behind[1]
    assert "wrote no record" in behind[3]
    # The flight recorder's sequence numbers name a rank that never enqueued the collective the others wait in,
    # even where the heartbeats agree (FSDP's all-gathers run in the forward).
    same = {0: _record(5, "forward", collectives={"0": 13}), 1: _record(5, "forward", collectives={"0": 12})}
    assert laggards(same, 2) == {1: "enqueued collective #12 of process group 0 last; rank(s) 0 wait in #13"}
    # A rank between steps is ahead of one still in that step's optimizer step, behind one in the next batch.
    assert sorted(
        laggards({0: _record(5, "between steps"), 1: _record(5, "optimizer step"), 2: _record(6, "forward")}, 3)
    ) == [0, 1]
    text = summary_text(
        {0: _record(5, "backward"), 1: _record(5, "backward")}, 2, detected="rank 0", exit_code=75, directory="d"
    )
    assert "No rank is behind another" in text and "status 75" in text


# ---------------------------------------------------------------- one process: the thread, the dump, the exit


def _stall_here(event: threading.Event) -> None:
    event.wait(30)  # the "training loop" of the single-process tests, stuck in its step


def test_a_hang_reports_the_phase_of_its_own_step_not_one_entered_in_the_step_before(tmp_path: Path) -> None:
    exits: list[int] = []
    watchdog = StepWatchdog(
        HangTimeout(floor_s=1, warmup_s=1), rank=0, world_size=1, directory=tmp_path, exit=exits.append
    )
    watchdog.step_started(global_step=0)
    watchdog.entered("backward")
    watchdog.step_started(global_step=1)  # batch 1 stalls before its backward
    assert watchdog.check(now=time.monotonic() + 100) and exits == [HANG_EXIT_CODE]
    assert watchdog.record is not None and (watchdog.record["batch"], watchdog.record["phase"]) == (1, PHASES[0])


def test_a_stalled_step_dumps_the_training_threads_stack_writes_the_summary_and_exits(tmp_path: Path) -> None:
    exits: list[int] = []
    watchdog = StepWatchdog(
        HangTimeout(floor_s=0.3, warmup_s=0.3),
        rank=0,
        world_size=1,
        directory=tmp_path / "hang",
        poll_s=0.05,
        exit=exits.append,
    )
    release = threading.Event()

    def training_loop() -> None:
        watchdog.step_started(global_step=0)
        watchdog.entered("backward")
        _stall_here(release)

    loop = threading.Thread(target=training_loop, name="loop")
    watchdog.start()
    start, wall = time.monotonic(), time.time()
    loop.start()
    try:
        deadline = time.monotonic() + 20
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        release.set()
        loop.join()
        watchdog.stop()
    assert exits == [HANG_EXIT_CODE] and time.monotonic() - start < 10
    stacks = (tmp_path / "hang" / "rank0.txt").read_text()
    assert (
        "(the training loop)" in stacks and "in _stall_here" in stacks and "lightning-scale-hang-watchdog" not in stacks
    )
    assert watchdog.record is not None and watchdog.record["phase"] == "backward"
    assert watchdog.record["where"] is not None  # the innermost frame: threading's wait, inside _stall_here
    assert "Hang detected by rank 0 (batch 0 ran" in (tmp_path / "hang" / "summary.txt").read_text()
    (event,) = [json.loads(line) for line in (tmp_path / "hang" / "events.jsonl").read_text().splitlines()]
    assert event["event"] == "hang" and event["exit_code"] == HANG_EXIT_CODE and event["laggards"] == []
    # When the hung step started, by the wall clock (goodput's hang detection time): the record's time less the step's.
    record = event["records"]["0"]
    assert abs(record["unix_s"] - record["step_s"] - wall) < 0.2, (record, wall)


def test_ranks_meet_in_the_store_every_one_reports_and_one_summary_names_the_one_behind(tmp_path: Path) -> None:
    store, exits = dist.HashStore(), {0: [], 1: []}
    policy = HangTimeout(floor_s=0.5, warmup_s=0.5)
    dogs = [
        StepWatchdog(
            policy,
            rank=r,
            world_size=2,
            directory=tmp_path / "hang",
            store=store,
            namespace="t",
            poll_s=0.05,
            grace_s=10,
            exit=exits[r].append,
        )
        for r in (0, 1)
    ]
    dogs[0].step_started(3)
    dogs[0].entered("backward")  # rank 0 waits in the gradient reduction rank 1 never reached
    dogs[1].step_started(3)
    now = time.monotonic()
    # Rank 1's step is over its limit: it declares; rank 0, within its own, sees the declaration.
    first = threading.Thread(target=dogs[1].check, args=(now + 1.0,))
    first.start()
    deadline = time.monotonic() + 10
    while not dogs[0].check(now + 0.1) and time.monotonic() < deadline:
        time.sleep(0.05)
    first.join()
    assert exits == {0: [HANG_EXIT_CODE], 1: [HANG_EXIT_CODE]}
    assert dogs[0].declared == dogs[1].declared and dogs[0].declared.startswith("rank 1 (batch 0 ran 1.0 s")
    summary = (tmp_path / "hang" / "summary.txt").read_text()
    assert "Ranks that never reached the point the others wait at: 1" in summary, summary
    assert {p.name for p in (tmp_path / "hang").iterdir()} == {"rank0.txt", "rank1.txt", "summary.txt", "events.jsonl"}


# ---------------------------------------------------------------- two processes under the strategy


class _StallingModule(StackModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == STALL_AT and self.global_rank == 1:
            _stall_rank_one(Path(self.trainer.default_root_dir))
        return super().training_step(batch, batch_idx)


def _stall_rank_one(root: Path) -> None:
    (root / "stalled_at").write_text(repr(time.time()))
    time.sleep(600)  # rank 0 meanwhile waits in this step's gradient all-reduce


def _data() -> DataLoader:
    tokens = torch.randint(0, 256, (64, 9), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


def _fit_stalling(rank: int, world: int, root: str) -> None:
    strategy = HybridParallelStrategy(data_parallel=world, hang_timeout={"floor_s": FLOOR_S, "warmup_s": 120})
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=10, default_root_dir=root)
    trainer.fit(_StallingModule(), train_dataloaders=_data())


def test_rank_one_stalls_in_a_step_both_ranks_write_stacks_the_summary_names_it_and_both_exit(tmp_path: Path) -> None:
    # The CPU flight recorder on: the reports carry each rank's last collectives.
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(_fit_stalling, 2, str(tmp_path), timeout=240, env={"TORCH_FR_BUFFER_SIZE": "200"})
    assert failure.value.exit_codes == {0: HANG_EXIT_CODE, 1: HANG_EXIT_CODE}, failure.value
    hang = tmp_path / "hang"
    stalled_at = float((tmp_path / "stalled_at").read_text())
    for rank in (0, 1):
        written = (hang / f"rank{rank}.txt").stat().st_mtime
        assert written - stalled_at < FLOOR_S + 30, (rank, written - stalled_at)
    rank1 = (hang / "rank1.txt").read_text()
    assert "in _stall_rank_one" in rank1 and "time.sleep(600)" in rank1  # the blocking frame, named
    assert "flight recorder (CPU)" in rank1
    summary = (hang / "summary.txt").read_text()
    assert "Ranks that never reached the point the others wait at: 1\n" in summary, summary
    assert f"rank 1: forward of batch {STALL_AT} (global step {STALL_AT})" in summary, summary
    assert f"rank(s) 0 reached backward of batch {STALL_AT}" in summary, summary
    (event,) = [json.loads(line) for line in (hang / "events.jsonl").read_text().splitlines()]
    assert event["laggards"] == [1] and event["exit_code"] == HANG_EXIT_CODE
    # Rank 0 enqueued the gradient all-reduce rank 1 never reached: the flight recorder says so too.
    assert event["records"]["0"]["collectives"]["0"] == event["records"]["1"]["collectives"]["0"] + 1, event["records"]


class _Beats(Callback):
    """At the last step: the strategy's own watchdog, beaten by its methods (no callback of it in the fit)."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        dog = trainer.strategy.resilience.watchdog
        if trainer.global_step == trainer.max_steps:
            self.seen = {"running": dog is not None}
            if dog is not None:
                self.seen |= {"batches_started": dog._started, "steps_timed": dog._completed}


def _fit_normally(rank: int, world: int, root: str) -> dict[str, Any]:
    found = {}
    for timeout in ({"floor_s": FLOOR_S, "warmup_s": 120}, 0):
        strategy = HybridParallelStrategy(data_parallel=world, hang_timeout=timeout)
        beats = _Beats()
        trainer = quiet_trainer(
            devices=world, strategy=strategy, max_steps=12, default_root_dir=root, callbacks=[beats]
        )
        trainer.fit(StackModule(), train_dataloaders=_data())
        found[str(timeout)] = {
            "callbacks": [type(c).__name__ for c in trainer.callbacks if isinstance(c, HangWatchdog)],
            "running": [t.name for t in threading.enumerate() if t.name == "lightning-scale-hang-watchdog"],
            "step": trainer.global_step,
            "beats": beats.seen,
            "stopped": strategy.resilience.watchdog is None,
        }
    return found


def test_a_normal_run_never_triggers_it_and_zero_turns_it_off(tmp_path: Path) -> None:
    on, off = run_distributed(_fit_normally, 2, str(tmp_path), timeout=240)[1].values()
    # The strategy's own methods beat the heart (12 batches started; each of the 11 before the last timed by the
    # next one's start), with no callback in the fit; stopped when the fit ends.
    assert on == {
        "callbacks": [],
        "running": [],
        "step": 12,
        "beats": {"running": True, "batches_started": 12, "steps_timed": 11},
        "stopped": True,
    }
    assert off == {"callbacks": [], "running": [], "step": 12, "beats": {"running": False}, "stopped": True}
    assert not (tmp_path / "hang").exists()


# ---------------------------------------------------------------- what a healthy job does is not a hang (issue 39)


class _SlowSave(Callback):
    """Every rank's first checkpoint hook takes twice the limit (a slow upload, a large state to gather)."""

    def __init__(self) -> None:
        self.slept = False

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if not self.slept:
            self.slept = True
            time.sleep(2 * FLOOR_S)


class _SlowValidation(StackModule):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(2 * FLOOR_S)  # every rank: a validation twice as long as the limit of a step
        return super().validation_step(batch, batch_idx)


class _SkippedCollective(StackModule):
    """The first step of the resumed fit: rank 0 enters an all-reduce rank 1 never reaches (both in its forward)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 4:
            if self.global_rank == 1:
                _stall_rank_one(Path(self.trainer.default_root_dir))
            dist.all_reduce(torch.ones(1))
        return super().training_step(batch, batch_idx)


def _healthy_then_resumed_and_stalled(rank: int, world: int, root: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    limit = {"floor_s": FLOOR_S, "warmup_s": 120}  # 120 s for the run's first 3 steps, as the torchrun test
    saves = {"dirpath": f"{root}/ckpt", "every_n_train_steps": 4, "save_top_k": -1}
    trainer = quiet_trainer(
        devices=world,
        strategy=HybridParallelStrategy(data_parallel=world, hang_timeout=limit),
        max_steps=6,
        default_root_dir=root,
        enable_checkpointing=True,
        callbacks=[_SlowSave(), ModelCheckpoint(**saves)],
        limit_val_batches=1,
        val_check_interval=5,
        num_sanity_val_steps=0,
    )
    trainer.fit(_SlowValidation(), train_dataloaders=_data(), val_dataloaders=_data())
    Path(root, f"healthy_fit_done_{rank}").write_text(str(trainer.global_step))
    # The run resumed at step 4 (a restart's auto-resume does the same): past the warm-up steps, its first step is
    # timed against the 3 s floor, not the warm-up's 120 s.
    trainer = quiet_trainer(
        devices=world,
        strategy=HybridParallelStrategy(data_parallel=world, hang_timeout=limit),
        max_steps=10,
        default_root_dir=root,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(**(saves | {"every_n_train_steps": 100}))],
    )
    trainer.fit(_SkippedCollective(), train_dataloaders=_data(), ckpt_path="latest")


def test_slow_checkpoint_hooks_and_validation_are_untimed_and_a_resumed_stall_is_named_in_its_collective(
    tmp_path: Path,
) -> None:
    # No flight recorder: the ranks' own beats and stacks name the rank that never entered the all-reduce.
    env = {"TORCH_FR_BUFFER_SIZE": ""} if "TORCH_FR_BUFFER_SIZE" in os.environ else None
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(_healthy_then_resumed_and_stalled, 2, str(tmp_path), timeout=240, env=env)
    # A checkpoint hook and a validation of twice the limit each: the first fit ran to its end on both ranks.
    assert [(tmp_path / f"healthy_fit_done_{r}").read_text() for r in (0, 1)] == ["6", "6"], failure.value
    assert failure.value.exit_codes == {0: HANG_EXIT_CODE, 1: HANG_EXIT_CODE}, failure.value
    hang = tmp_path / "hang"
    stalled_at = float((tmp_path / "stalled_at").read_text())
    for rank in (0, 1):  # within the limit after the restart, not the warm-up allowance (120 s)
        assert (hang / f"rank{rank}.txt").stat().st_mtime - stalled_at < FLOOR_S + 10, rank
    summary = (hang / "summary.txt").read_text()
    assert "Ranks that never reached the point the others wait at: 1\n" in summary, summary
    assert "rank 1: never entered the collective rank(s) 0 wait in (all_reduce (distributed_c10d.py:" in summary
    assert "in forward of batch 0 (global step 4)" in summary and "in _stall_rank_one" in summary, summary
    (event,) = [json.loads(line) for line in (hang / "events.jsonl").read_text().splitlines()]
    assert event["laggards"] == [1] and event["records"]["0"]["collective"].startswith("all_reduce")
    assert event["records"]["1"]["collective"] is None and event["records"]["1"]["collectives"] == {}


def test_the_watchdog_and_preemption_callbacks_are_refused_beside_the_strategys_own(tmp_path: Path) -> None:
    from lightning_scale.callbacks import PreemptionCheckpoint
    from lightning_scale.plugins import ShardedCheckpointIO

    for callback, match in [
        (HangWatchdog(), r"HybridParallelStrategy runs a hang watchdog of its own \(hang_timeout='auto'\).*"),
        (PreemptionCheckpoint(), r"HybridParallelStrategy handles SIGTERM and SIGUSR1 itself.*preemption=False"),
    ]:
        trainer = quiet_trainer(devices=1, strategy=HybridParallelStrategy(), callbacks=[callback], max_steps=1)
        with pytest.raises(ValueError, match=match):
            callback.setup(trainer, StackModule(), "fit")
    # With the strategy's own off, the callbacks are the ones in charge (their own options).
    for callback in (HangWatchdog(5), PreemptionCheckpoint(("SIGUSR1",))):
        strategy = HybridParallelStrategy(hang_timeout=0, checkpoint_io=ShardedCheckpointIO(preemption=False))
        callback.setup(quiet_trainer(devices=1, strategy=strategy, callbacks=[callback]), StackModule(), "fit")


def test_the_old_import_paths_warn_and_name_the_new_one() -> None:
    import importlib
    import sys

    for module, name, new in [
        ("lightning_scale.plugins", "HangWatchdog", "lightning_scale.callbacks.hang_watchdog.HangWatchdog"),
        ("lightning_scale.plugins.hang_watchdog", "HangWatchdog", "lightning_scale.callbacks.hang_watchdog"),
        ("lightning_scale.plugins.preemption", "PreemptionCheckpoint", "lightning_scale.callbacks.preemption"),
        ("lightning_scale.plugins.preemption", "Preempted", "lightning_scale.callbacks.preemption"),
    ]:
        sys.modules.pop(module, None) if module != "lightning_scale.plugins" else None
        with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
            found = getattr(importlib.import_module(module), name)
        assert found is getattr(importlib.import_module(new.rpartition(".")[0] if new.endswith(name) else new), name)


# ---------------------------------------------------------------- torchrun relaunches, the run resumes


@pytest.mark.slow
def test_under_torchrun_a_hang_relaunches_the_job_which_resumes_from_latest_and_completes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.5",
        str(ROOT / "tests" / "scripts" / "elastic_run.py"),
        str(tmp_path),
        "dp2",
        "12",
        f"--hang-at={STALL_AT + 1}",
    ]
    proc = subprocess.run(command, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    journal = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    starts = {(r["restart"], r["rank"]): r for r in journal}
    assert sorted(starts) == [(0, 0), (0, 1), (1, 0), (1, 1)], journal
    assert {starts[(1, r)]["start_step"] for r in (0, 1)} == {4}, journal  # "latest": the step-4 checkpoint
    assert all(starts[(1, r)]["resumed_step"] == 4 for r in (0, 1)), journal
    assert (
        "Ranks that never reached the point the others wait at: 1\n" in (tmp_path / "hang" / "summary.txt").read_text()
    )
    assert f"failed (exitcode: {HANG_EXIT_CODE})" in proc.stderr, proc.stderr[
        -3000:
    ]  # torchrun's word on the first launch
    assert (tmp_path / "final" / "manifest.json").is_file()  # the relaunch trained to the end and saved
