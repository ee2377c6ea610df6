"""Goodput accounting (issue 27): where a run's wall time went across its attempts, from hand-built ledgers
(exact arithmetic), what the ledger refuses to trust, and the monitor's ledger from real fits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.lightning import quiet_trainer
from helpers.models import StackModule
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale.callbacks import GoodputMonitor
from lightning_scale.callbacks import goodput as goodput_callback
from lightning_scale.callbacks.goodput import GOODPUT_METRICS
from lightning_scale.core.resilience.goodput import PARTS, parse_event, read_ledger, summarize
from lightning_scale.core.resilience.goodput_ledger import ProgressWriter, append_event, process_start_time

ROOT = Path(__file__).resolve().parents[1]


def _start(
    attempt: str, time: float, *, resumed: int | None = None, commit: float | None = None, relaunch: bool = False
) -> dict[str, Any]:
    return {
        "event": "start",
        "attempt": attempt,
        "time": time,
        "step": resumed or 0,
        "relaunch": relaunch,
        "resumed_step": resumed,
        "resumed_commit": commit,
        "restart_count": int(relaunch),
        "pid": 1,
    }


def _ev(kind: str, attempt: str, time: float, **fields: Any) -> dict[str, Any]:
    return {"event": kind, "attempt": attempt, "time": time, **fields}


def _write(
    run_dir: Path,
    events: list[dict[str, Any]],
    progress: dict[str, tuple[int, float]] = {},
    hangs: list[dict[str, Any]] = (),
) -> None:
    for event in events:
        append_event(run_dir, event)
    for attempt, (step, seconds) in progress.items():
        (run_dir / "goodput" / f"progress-{attempt}.json").write_text(
            json.dumps({"attempt": attempt, "step": step, "time": seconds})
        )
    if hangs:
        (run_dir / "hang").mkdir()
        (run_dir / "hang" / "events.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hangs))


def test_two_interruptions_one_of_them_a_hang_split_the_wall_time_exactly(tmp_path: Path) -> None:
    _write(
        tmp_path,
        [
            # a1: start-up 10 s, saves at steps 10 and 20 (2 s blocking each), SIGKILLed: last seen alive at 165 (step 27)
            _start("a1", 100.0),
            _ev("first_step", "a1", 110.0, step=0),
            _ev("checkpoint", "a1", 130.0, step=10, blocking_s=2.0),
            _ev("checkpoint", "a1", 150.0, step=20, blocking_s=2.0),
            # a2: relaunched at 170, resumes step 20; start-up 8 s; a save at step 30; hangs (declared at 230, 12 s in)
            _start("a2", 170.0, resumed=20, commit=150.0, relaunch=True),
            _ev("first_step", "a2", 178.0, step=20),
            _ev("checkpoint", "a2", 200.0, step=30, blocking_s=1.0),
            # a3: relaunched at 240, resumes step 30; start-up 9 s; completes at 280
            _start("a3", 240.0, resumed=30, commit=200.0, relaunch=True),
            _ev("first_step", "a3", 249.0, step=30),
            _ev("checkpoint", "a3", 260.0, step=40, blocking_s=1.5),
            _ev("end", "a3", 280.0, step=45, status="completed"),
        ],
        progress={"a1": (27, 165.0), "a2": (33, 233.0), "a3": (45, 280.0)},
        hangs=[
            {
                "event": "hang",
                "time": 230.0,
                "records": {"0": {"step_s": 12.0, "unix_s": 229.0}, "1": {"step_s": 11.5, "unix_s": 229.5}},
            }
        ],
    )
    ledger = read_ledger(tmp_path)
    assert ledger.problems == []
    s = summarize(ledger.attempts)
    assert s is not None
    assert s.total_s == 180.0
    assert s.productive_s == (150 - 110 - 4) + (200 - 178 - 1) + (280 - 249 - 1.5) == 86.5
    assert s.lost_s == (165 - 150) + (217 - 200) == 32.0  # a2 stopped when its hung step started: 229 - 12
    assert s.checkpoint_s == 6.5
    assert s.startup_s == 10.0
    assert s.rendezvous_s == (170 - 165) + (240 - 230) == 15.0
    assert s.restart_s == 15.0 + 8.0 + 9.0
    assert s.hang_detection_s == 230.0 - 217.0  # the watchdog's 12 s limit, and 1 s of reports
    assert s.unaccounted_s == 0.0 and sum(getattr(s, p) for p in PARTS) == s.total_s
    assert s.goodput == 86.5 / 180.0
    assert s.mttr_s == ((178 - 165) + (249 - 217)) / 2
    assert (s.attempts, s.interruptions, s.hangs) == (3, 2, 1)
    assert [r["status"] for r in s.per_attempt] == ["killed", "hang", "completed"]
    assert [r["lost_s"] for r in s.per_attempt] == [15.0, 17.0, 0.0]


def test_a_hang_from_before_records_were_dated_counts_the_longest_step(tmp_path: Path) -> None:
    _write(
        tmp_path,
        [_start("a", 0.0), _ev("first_step", "a", 5.0, step=0), _start("b", 40.0, relaunch=True)],
        hangs=[
            {"event": "hang", "time": 30.0, "records": {"0": {"step_s": 10.0}, "1": {"step_s": 9.0, "unix_s": "x"}}}
        ],
    )
    s = summarize(read_ledger(tmp_path).attempts, now=50.0)
    assert s is not None and (s.hang_detection_s, s.lost_s, s.rendezvous_s, s.hangs) == (10.0, 15.0, 10.0, 1)


def test_a_run_without_interruptions_has_goodput_productive_over_total() -> None:
    ledger_dir_events = [
        _start("a", 0.0),
        _ev("first_step", "a", 4.0, step=0),
        _ev("checkpoint", "a", 10.0, step=5, blocking_s=1.0),
        _ev("end", "a", 20.0, step=10, status="completed"),
    ]
    from lightning_scale.core.resilience.goodput import Ledger

    ledger = Ledger()
    for event in ledger_dir_events:
        ledger.add(parse_event(event))
    s = summarize(ledger.attempts)
    assert s is not None
    assert (s.total_s, s.productive_s, s.checkpoint_s, s.startup_s, s.lost_s, s.restart_s) == (
        20.0,
        15.0,
        1.0,
        4.0,
        0.0,
        0.0,
    )
    assert s.goodput == 0.75 and s.mttr_s is None and s.interruptions == 0
    live = summarize(ledger.attempts, now=30.0)
    assert live is not None and live.total_s == 20.0  # an ended attempt stays ended


def test_a_running_attempt_counts_up_to_now_and_a_new_run_starts_after_a_completed_one(tmp_path: Path) -> None:
    _write(
        tmp_path,
        [
            _start("old", 0.0),
            _ev("first_step", "old", 1.0, step=0),
            _ev("end", "old", 50.0, step=10, status="completed"),
            _start("new", 100.0, resumed=10, commit=49.0),
            _ev("first_step", "new", 103.0, step=10),
            _ev("checkpoint", "new", 110.0, step=12, blocking_s=0.5),
        ],
    )
    s = summarize(read_ledger(tmp_path).attempts, now=120.0)
    assert s is not None and s.attempts == 1  # the completed run before is another run
    assert (s.total_s, s.startup_s, s.productive_s, s.checkpoint_s) == (20.0, 3.0, 16.5, 0.5)
    assert s.per_attempt[0]["status"] == "running"


def test_an_attempt_killed_before_its_first_checkpoint_loses_all_its_training(tmp_path: Path) -> None:
    _write(
        tmp_path,
        [
            _start("a", 0.0),
            _ev("first_step", "a", 5.0, step=0),
            _start("b", 30.0, relaunch=True),
            _ev("first_step", "b", 36.0, step=0),
            _ev("end", "b", 60.0, step=8, status="completed"),
        ],
        progress={"a": (3, 25.0)},
    )
    s = summarize(read_ledger(tmp_path).attempts)
    assert s is not None
    assert (s.lost_s, s.productive_s, s.rendezvous_s, s.restart_s, s.startup_s) == (20.0, 24.0, 5.0, 11.0, 5.0)
    assert s.mttr_s == 11.0 and s.goodput == 24.0 / 60.0


def test_a_checkpoint_whose_record_was_lost_is_dated_by_its_manifest(tmp_path: Path) -> None:
    _write(
        tmp_path,
        [
            _start("a", 0.0),
            _ev("first_step", "a", 5.0, step=0),  # killed before its save of step 10 was recorded
            _start("b", 60.0, resumed=10, commit=30.0, relaunch=True),
            _ev("first_step", "b", 65.0, step=10),
            _ev("end", "b", 70.0, step=12, status="completed"),
        ],
        progress={"a": (14, 50.0)},
    )
    s = summarize(read_ledger(tmp_path).attempts)
    assert s is not None and (s.productive_s, s.lost_s, s.restart_s) == (25.0 + 5.0, 20.0, 15.0)


def test_the_ledger_trusts_no_field_and_skips_what_it_cannot_read(tmp_path: Path) -> None:
    _write(
        tmp_path,
        [_start("a", 0.0), _ev("first_step", "a", 2.0, step=0), _ev("end", "a", 10.0, step=3, status="completed")],
    )
    with open(tmp_path / "goodput" / "events.jsonl", "a") as f:
        f.write(json.dumps(_ev("checkpoint", "a", "soon", step=1, blocking_s=1.0)) + "\n")
        f.write(json.dumps(_ev("checkpoint", "zz", 3.0, step=1, blocking_s=1.0)) + "\n")
        f.write('{"event": "checkpoint", "attempt": "a", "ti')  # cut short by a kill
    ledger = read_ledger(tmp_path)
    assert len(ledger.problems) == 3
    assert "time='soon' is not a non-negative number" in ledger.problems[1]
    assert "attempt 'zz', which has no start event" in ledger.problems[2]
    assert "not JSON" in ledger.problems[0]
    s = summarize(ledger.attempts)
    assert s is not None and (s.total_s, s.productive_s, s.checkpoint_s) == (10.0, 8.0, 0.0)
    with pytest.raises(ValueError, match=r"status='done' is not one of \('completed', 'interrupted'\)"):
        parse_event(_ev("end", "a", 1.0, step=0, status="done"))
    with pytest.raises(ValueError, match=r"start event: relaunch=1 is not a non-negative bool"):
        parse_event({**_start("a", 0.0), "relaunch": 1})
    with pytest.raises(ValueError, match="not an event"):
        append_event(tmp_path, {"event": "rm -rf", "time": 1.0})
    assert summarize([]) is None


def test_the_process_start_is_the_one_ps_reports() -> None:
    elapsed = int(
        subprocess.run(["ps", "-o", "etimes=", "-p", str(os.getpid())], capture_output=True, text=True).stdout
    )
    assert abs((time.time() - process_start_time()) - elapsed) < 1.5  # ps counts whole seconds


# ---------------------------------------------------------------- the monitor in real fits


class _Slow(Callback):
    """Steps of about ``seconds``, so the ledger's times are long against the clock's resolution."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        time.sleep(self.seconds)


def _fit(root: Path, steps: int, ckpt_path: str | None = None) -> tuple[Trainer, GoodputMonitor]:
    monitor = GoodputMonitor(progress_s=0.05)
    checkpoint = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    trainer = quiet_trainer(
        max_steps=steps,
        default_root_dir=root,
        log_every_n_steps=2,
        enable_checkpointing=True,
        callbacks=[monitor, checkpoint, _Slow(0.05)],
    )
    trainer.fit(StackModule(), train_dataloaders=_data(), ckpt_path=ckpt_path)
    return trainer, monitor


def _data() -> DataLoader:
    tokens = torch.randint(0, 256, (64, 9), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


def test_the_monitor_writes_the_ledger_logs_goodput_and_a_later_fit_starts_a_run_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(goodput_callback, "_fits_in_process", 0)  # this process's first fit: dated from its start
    begin = time.time()
    trainer, monitor = _fit(tmp_path, 8)
    events = [json.loads(line) for line in (tmp_path / "goodput" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "first_step", "checkpoint", "checkpoint", "end"]
    assert [e.get("step") for e in events] == [0, 0, 4, 8, 8] and events[-1]["status"] == "completed"
    assert events[0]["time"] < begin and events[0]["resumed_step"] is None and events[0]["relaunch"] is False
    assert all(e["blocking_s"] > 0 for e in events if e["event"] == "checkpoint")
    assert set(trainer.callback_metrics) >= set(GOODPUT_METRICS) - {"goodput/mttr_s"}
    s = monitor.summary
    assert s is not None and s.attempts == 1 and s.unaccounted_s == 0.0
    assert s.productive_s > 8 * 0.05 and s.checkpoint_s == sum(e["blocking_s"] for e in events[2:4])
    assert s.total_s == events[-1]["time"] - events[0]["time"]
    # The progress file: the last step, seen alive at the end.
    (progress,) = (tmp_path / "goodput").glob("progress-*.json")
    assert json.loads(progress.read_text())["step"] == 8

    # A later fit resuming step 4's checkpoint follows a completed attempt: a run of its own.
    _, again = _fit(tmp_path, 10, ckpt_path=str(tmp_path / "ckpt" / "step=4.ckpt"))
    assert again.summary is not None and again.summary.attempts == 1
    start = [json.loads(line) for line in (tmp_path / "goodput" / "events.jsonl").read_text().splitlines()][5]
    assert start["event"] == "start" and start["resumed_step"] == 4
    assert start["resumed_commit"] == (tmp_path / "ckpt" / "step=4.ckpt").stat().st_mtime


def test_the_progress_file_reads_the_step_through_a_function_and_keeps_the_last_when_it_fails(tmp_path: Path) -> None:
    steps = iter([3, 7])

    def step() -> int:
        return next(steps)  # then StopIteration: what it reads is gone (a trainer torn down)

    writer = ProgressWriter(tmp_path, "a", step=step, period_s=60)
    writer.path.parent.mkdir(parents=True)
    for expected in (3, 7, 7):
        writer.write()
        assert json.loads(writer.path.read_text())["step"] == expected


def test_progress_s_must_be_a_positive_number_of_seconds() -> None:
    with pytest.raises(ValueError, match=r"progress_s=0 must be a positive number of seconds\. It is how often"):
        GoodputMonitor(progress_s=0)


# ---------------------------------------------------------------- SIGKILLed under torchrun, relaunched, resumed


@pytest.mark.slow
def test_a_sigkilled_run_relaunched_by_torchrun_reports_the_lost_work_and_restart_it_had(tmp_path: Path) -> None:
    """Rank 0 SIGKILLs both ranks 8 steps (about 1.5 s) after the step-30 checkpoint; torchrun relaunches, the
    relaunch resumes step 30 and completes. The ledger's lost work and restart time match the script's own
    clock readings within 10%."""
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
        str(ROOT / "tests" / "scripts" / "goodput_kill.py"),
        str(tmp_path),
        "40",
        "10",
        "38",
        "0.15",
    ]
    proc = subprocess.run(command, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    truth = [json.loads(line) for line in (tmp_path / "truth.jsonl").read_text().splitlines()]
    (kill,) = [t["kill"] for t in truth if "kill" in t]
    (after_save,) = [t["after_save"] for t in truth if t.get("step") == 30 and t["restart"] == 0 and "after_save" in t]
    (relaunched,) = [t for t in truth if t["restart"] == 1 and "first_step" in t]
    assert relaunched["step"] == 30  # resumed from the step-30 checkpoint
    ledger = read_ledger(tmp_path)
    assert ledger.problems == []
    s = summarize(ledger.attempts)
    assert s is not None and (s.attempts, s.interruptions, s.hangs) == (2, 1, 0)
    assert [r["status"] for r in s.per_attempt] == ["killed", "completed"]
    lost, restart = kill - after_save, relaunched["first_step"] - kill
    assert lost > 1.0 and abs(s.lost_s - lost) <= 0.1 * lost, (s.lost_s, lost)
    assert abs(s.restart_s - restart) <= 0.1 * restart, (s.restart_s, restart)
    print(f"lost {s.lost_s:.3f} s (truth {lost:.3f}), restart {s.restart_s:.3f} s (truth {restart:.3f}), {s}")
    assert abs((s.lost_s + s.restart_s) - (lost + restart)) <= 0.1 * (lost + restart)
    assert s.mttr_s == pytest.approx(s.restart_s, abs=1e-6)  # one interruption: its recovery is the restart
    assert s.unaccounted_s == pytest.approx(0.0, abs=1e-6) and 0 < s.goodput < 1
    assert s.checkpoint_s > 0 and s.rendezvous_s > 0
