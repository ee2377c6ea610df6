"""``lightning-scale-study``: options and pruners, refusals before any job starts, a hyper-parameter study
that prunes, the driver SIGKILLed mid-study and rerun, a layout study that calibrates and re-ranks, and a
budget that stops a study."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from lightning_scale.cli.study import Study, halving_rungs, main, parse_options
from lightning_scale.cli.study_state import (
    StudyOptions,
    StudyState,
    halving_survivors,
    log_points,
    rung_metric,
    should_prune,
)

# A small job of 2 processes: 16 steps, validation every 8 (the rung at 8).
SMALL = [
    "trainer.devices=2",
    "trainer.max_steps=16",
    "trainer.val_check_interval=8",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=2",
    "callbacks.console.every_n_steps=2",
    "data.seq_len=64",
    "data.global_batch_size=8",
    "validate_before_fit=false",
]
GRID = "module.learning_rate=3e-3,1e-6,1e-2"
PAIR = "module.learning_rate=3e-3,1e-6"  # the first two trials of GRID


def _study(tmp: Path, name: str, *args: str) -> list[str]:
    return [f"study.dir={tmp}", f"study.name={name}", "study.poll_s=0.1", *SMALL, *args]


# ---------------------------------------------------------------------------------------------- unit


def test_the_median_pruner_stops_a_trial_worse_than_the_median_of_those_before_it() -> None:
    loss = StudyOptions(kind="hparams", pruner="median")
    assert not should_prune(loss, 9.0, [])  # nothing to compare with
    assert should_prune(loss, 3.0, [1.0, 2.0, 2.5])  # lower is better; median 2.0
    assert not should_prune(loss, 2.0, [1.0, 2.0, 2.5])
    speed = StudyOptions(kind="layouts", pruner="median")
    assert should_prune(speed, 90.0, [100.0, 120.0]) and not should_prune(speed, 111.0, [100.0, 120.0])
    assert should_prune(loss, float("nan"), [1.0])
    assert not should_prune(StudyOptions(kind="hparams", pruner="none"), 99.0, [1.0, 2.0])


def test_successive_halving_keeps_the_best_one_in_eta_of_those_at_a_rung() -> None:
    sh = StudyOptions(kind="hparams", pruner="successive_halving", eta=3)
    assert not should_prune(sh, 1.0, [2.0, 3.0])  # the best of 3: goes on
    assert should_prune(sh, 2.5, [2.0, 3.0])  # keep ceil(3/3) = 1
    assert not should_prune(sh, 2.5, [2.0, 3.0, 4.0])  # keep ceil(4/3) = 2: second best goes on


def test_a_rung_tolerance_keeps_the_trials_too_close_to_the_cut_to_tell_apart() -> None:
    # The benchmark's 540-step study: at its second rung lr 1e-3 (2.4903) was kept and lr 3e-3 (2.4996,
    # 0.4% behind) cut; lr 3e-3 ended 11% better. Within 1%, both go on; 2.532 (1.7% behind) does not.
    rung = [2.5322, 2.4996, 2.4903]
    tied = StudyOptions(kind="hparams", pruner="successive_halving", eta=3, rung_tolerance=0.01)
    assert halving_survivors(tied, rung) == [2.4903, 2.4996]
    assert not should_prune(tied, 2.4996, [2.4903, 2.5322]) and should_prune(tied, 2.5322, [2.4903, 2.4996])
    classic = StudyOptions(kind="hparams", pruner="successive_halving", eta=3)
    assert halving_survivors(classic, rung) == [2.4903]
    speed = StudyOptions(kind="layouts", pruner="successive_halving", eta=2, rung_tolerance=0.05)
    assert halving_survivors(speed, [100.0, 97.0, 90.0, 120.0]) == [120.0, 100.0, 97.0]  # 3% below the cut: kept
    assert halving_survivors(tied, [2.0, float("nan"), float("nan")]) == [2.0]


def test_with_a_rung_tolerance_a_trial_further_behind_the_best_at_a_validation_stops_there(tmp_path: Path) -> None:
    """Ties kept at the last rung are settled as they run on: past it, a trial more than ``rung_tolerance``
    behind the best value another trial had at the same step stops; within it, or up to the last rung, it
    goes on."""

    def study(tolerance: float) -> Study:
        options = parse_options(
            [f"study.dir={tmp_path}", f"study.name=t{tolerance}", "study.kind=hparams"]
            + ["study.pruner=successive_halving", "study.rungs=[8]", f"study.rung_tolerance={tolerance}"]
        )
        return Study(options, [*SMALL, "trainer.val_check_interval=4", "module.learning_rate=1e-3,3e-3,1e-2"])

    def validate(log: Path, step: int, loss: float) -> None:
        with log.open("a") as f:
            f.write(f"validation at step {step} | val/loss {loss}\n")

    s = study(0.01)
    first, second, third = (s.state.trial(n, order=i) for i, n in enumerate("abc"))
    logs = [tmp_path / f"{n}.log" for n in "abc"]
    for step, loss in [(4, 3.0), (8, 2.5), (12, 2.0)]:
        validate(logs[0], step, loss)
    assert s._behind_the_best(first, logs[0]) is None and first["curve"] == {"4": 3.0, "8": 2.5, "12": 2.0}
    validate(logs[1], 4, 3.5)  # 17% behind, but before the last rung: the rungs judge there
    assert s._behind_the_best(second, logs[1]) is None
    validate(logs[1], 8, 2.9)  # at the rung: successive halving's to judge
    assert s._behind_the_best(second, logs[1]) is None
    validate(logs[1], 12, 2.0199)  # 0.995% behind: a tie, goes on
    assert s._behind_the_best(second, logs[1]) is None
    validate(logs[0], 16, 1.8)
    s._behind_the_best(first, logs[0])
    validate(logs[1], 16, 1.83)  # 1.67% behind at step 16
    stop = s._behind_the_best(second, logs[1])
    assert stop is not None and stop["rung"] == 16 and stop["value_at_prune"] == 1.83
    assert "more than rung_tolerance 0.01 behind the best of 1 other trial(s) there (1.8)" in stop["reason"]
    validate(logs[2], 12, float("nan"))
    assert s._behind_the_best(third, logs[2]) is not None  # a diverged trial stops
    classic = study(0.0)  # classic successive halving judges at the rungs only
    for i, n in enumerate("abc"):
        classic.state.trial(n, order=i)
    assert [classic._behind_the_best(classic.state.trials[n], log) for n, log in zip("abc", logs)] == [None] * 3


def test_a_study_stored_before_an_option_existed_resumes_unless_this_run_sets_that_option(tmp_path: Path) -> None:
    options = StudyOptions(kind="hparams", pruner="successive_halving")
    stored = {k: v for k, v in asdict(options).items() if k != "rung_tolerance"}  # as written before it existed
    (tmp_path / "study.json").write_text(json.dumps({"options": stored, "base_overrides": ["a=1"], "trials": {}}))
    assert StudyState(tmp_path / "study.json", options, ["a=1"]).doc["options"] == asdict(options)
    changed = StudyOptions(kind="hparams", pruner="successive_halving", rung_tolerance=0.01)
    with pytest.raises(ValueError, match="holds a study with other options or overrides"):
        StudyState(tmp_path / "study.json", changed, ["a=1"])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["study.metric=loss"], r"study.metric='loss' is not a metric a study can rank on; choose one of"),
        (["study.budget_usd=0"], r"study.budget_usd=0 must be a positive number"),
        (["study.budget_gpu_hours=-1"], r"study.budget_gpu_hours=-1 must be a positive number"),
        (["study.k=0"], r"study.k=0 must be a positive integer"),
        (["study.pruner=hyperband"], r"study.pruner='hyperband' is not a pruner; choose one of"),
        (["study.eta=1"], r"study.eta=1 keeps every trial; successive halving needs eta >= 2"),
        (["study.launcher=submitit_slurm"], r"the pruner stops them with SIGTERM.*Use study.launcher=torchrun"),
        (["study.tolerance=2"], r"study.tolerance=2 must be a fraction in \[0, 1\)"),
        (["study.rung_tolerance=-0.1"], r"study.rung_tolerance=-0.1 must be a fraction in \[0, 1\) \(e.g. 0.01"),
        (["study.kind=grid"], r"study.kind='grid' is not a study kind"),
        (["study.rungs=[0]"], r"study.rungs=0 must be a positive integer"),
        (["study.colour=red"], r"study.colour is not a study option; the options are"),
        (["study.equal_tokens=true"], r"study.equal_tokens=true scales each trial's steps to its batch, but a layout"),
        (["study.kind=hparams", "study.equal_tokens=2"], r"study.equal_tokens=2 must be true or false"),
    ],
)
def test_bad_options_are_refused_naming_the_value_and_the_fix(args: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_options(args)


def test_successive_halvings_default_rungs_are_its_geometric_schedule_with_the_last_at_mid_run() -> None:
    assert halving_rungs(270, 30, 9, 3) == [30, 150]  # 9 -> 3 -> 1; the last rung at mid-run, not at 90
    assert halving_rungs(300, 50, 9, 3) == [50, 150]  # 300 / 9 = 33: the first validation at least
    assert halving_rungs(16, 8, 2, 2) == [8]
    assert halving_rungs(810, 10, 10, 3) == [30, 90, 410]  # 10 -> 4 -> 2 -> 1; 405 -> the validation after
    assert halving_rungs(540, 60, 16, 3) == [60, 300]  # 27ths and 9ths both at the first validation
    assert halving_rungs(100, 10, 1, 3) == []


def test_the_first_round_is_the_fastest_layout_and_those_that_pin_the_fitted_factors_best_per_second() -> None:
    from lightning_scale.cli.study_layouts import first_round

    def layout(sensitivity: list[float], step_time: float) -> dict[str, Any]:
        return {"sensitivity": sensitivity, "step_time": step_time}

    found = {  # d log(step time) / d log(compute, overhead, collectives), the fastest first
        "pipeline": layout([-0.70, 0.13, 0.0], 0.20),
        "pipeline_again": layout([-0.69, 0.14, 0.0], 0.20),  # says nothing the first does not
        "many_microbatches": layout([-0.50, 0.38, 0.0], 0.30),
        "tensor_parallel": layout([-0.30, 0.06, 0.60], 0.40),
        "tensor_parallel_slow": layout([-0.31, 0.06, 0.61], 4.0),  # as informative, ten times the cost
    }
    chosen = first_round(found, 3)
    assert chosen[0] == "pipeline" and set(chosen[1:]) == {"many_microbatches", "tensor_parallel"}
    assert first_round(found, 1) == ["pipeline"] and len(first_round(found, 9)) == 5


def test_a_running_trials_metric_is_read_off_its_log_at_each_rung(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text(
        "noise\nstep 2/12 | train/loss 5.0 | train/tokens_per_sec 1,234.5 | lr 1e-3 | 0.3 s/step\n"
        "validation at step 4 | val/loss 4.25\nstep 6/12 | train/loss 4.0 | train/tokens_per_sec 2000.0\n"
    )
    assert log_points(log, "train/tokens_per_sec") == [(2, 1234.5), (6, 2000.0)]
    assert rung_metric(log, "val/loss", 4) == 4.25 and rung_metric(log, "val/loss", 8) is None
    assert rung_metric(log, "train/tokens_per_sec", 4) == 2000.0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            ["study.k=9", "study.space={data_parallel_mode:[ddp],pipeline_parallel:[1]}"],
            r"study.k=9 but only \d+ layout",
        ),
        (["study.space={colour:[red]}"], r"study.space has 'colour', which is no layout option"),
        (["study.budget_gpu_hours=1e-9"], r"study.budget_gpu_hours=1e-09: the study's plan needs"),
        (["study.budget_usd=1"], r"study.budget_usd is set but no price is: set callbacks.cost.price_per_device_hour"),
        (["module.learning_rate=1e-3,3e-3"], r"study.kind=layouts takes its layouts from the planner"),
        (["study.kind=hparams"], r"study.kind=hparams needs at least two trials"),
        (
            ["study.kind=hparams", GRID, "study.rungs=[3]"],
            r"rungs \[3\] are not multiples of trainer.val_check_interval=8",
        ),
        (["data.seq_len=100000"], r"data.seq_len=100000 exceeds the model's context"),
        (
            ["study.kind=hparams", "study.equal_tokens=true", "data.global_batch_size=8,24"],
            r"the trial data.global_batch_size=24 takes 1536 tokens a step against the config's 512, so its "
            r"trainer.max_steps would be 16/3, trainer.val_check_interval would be 8/3, rung 8 would be 8/3 steps",
        ),
        (["strategy=ddp"], r"study.kind=layouts sets the layout of HybridParallelStrategy, but the config's strategy"),
    ],
)
def test_bad_studies_are_refused_before_any_job_starts(tmp_path: Path, args: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        main(_study(tmp_path, "bad", *args))
    assert not (tmp_path / "bad" / "trials").exists()


# ---------------------------------------------------------------------------------------------- studies


def _report(tmp: Path, name: str) -> dict[str, Any]:
    return json.loads((tmp / name / "study_report.json").read_text())


@pytest.fixture(scope="module")
def hparams(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("studies")
    args = _study(tmp, "lr", "study.kind=hparams", "study.pruner=median", GRID)
    assert main([*args, "logger=[csv,wandb]"]) == 0  # wandb offline: one run per trial
    return tmp, _report(tmp, "lr")


def test_a_hyper_parameter_study_prunes_a_weak_trial_which_commits_its_checkpoint(
    hparams: tuple[Path, dict[str, Any]],
) -> None:
    tmp, report = hparams
    trials = report["trials"]
    statuses = {n.rsplit("-", 1)[0]: t["status"] for n, t in trials.items()}
    assert statuses["learning_rate-0.003"] == "completed"
    weak = next(t for n, t in trials.items() if n.startswith("learning_rate-1e-06"))
    assert weak["status"] == "pruned" and "val_loss" in weak["reason"] and "at step 8" in weak["reason"]
    assert isinstance(weak["pruned_at"], int) and weak["pruned_at"] >= 8
    state = json.loads((tmp / "lr" / "study.json").read_text())
    run_dir = Path(next(t["run_dir"] for n, t in state["trials"].items() if n.startswith("learning_rate-1e-06")))
    assert (run_dir / "checkpoints" / f"step-{weak['pruned_at']:06d}").is_dir()  # committed at the step it stopped
    best = min((t["value"], n) for n, t in trials.items() if t["status"] == "completed")
    assert report["winner"] == best[1] and report["grid"]["trials"] == 3 and report["cost_vs_grid"] > 0
    assert (tmp / "lr" / "study.png").stat().st_size > 0
    ids = set()
    for trial in state["trials"].values():  # each trial its own wandb run, in its own directory
        ids.add(json.loads((Path(trial["run_dir"]) / "job.json").read_text())["wandb_run_id"])
        assert list((Path(trial["run_dir"]) / "wandb").glob("offline-run-*")), trial["run_dir"]
    assert len(ids) == len(state["trials"]) == 3
    winner = (tmp / "lr" / "winner.yaml").read_text()
    assert "module.learning_rate=" in winner and "lightning-scale-train" in winner


def test_successive_halving_pauses_every_trial_at_each_rung_and_resumes_the_best_exactly(
    hparams: tuple[Path, dict[str, Any]],
) -> None:
    """eta 2 of 3 trials: lr 3e-3 and 1e-6 pause at the rung (step 8); lr 1e-2, the round's last, meets the rung
    knowing the others' values and, kept, runs on without a stop. 1e-6 is pruned, 3e-3 resumes from its
    checkpoint; each ends where the same trial run without a pause ends."""
    tmp, uninterrupted = hparams
    assert (
        main(_study(tmp, "halving", "study.kind=hparams", "study.pruner=successive_halving", "study.eta=2", GRID)) == 0
    )
    report, state = _report(tmp, "halving"), json.loads((tmp / "halving" / "study.json").read_text())
    trials = report["trials"]
    by_lr = {n.rsplit("-", 1)[0].removeprefix("learning_rate-"): n for n in trials}
    assert all(set(t["rungs"]) >= {"8"} for t in trials.values())  # every trial reached the first rung
    weak = trials[by_lr["1e-06"]]
    assert weak["status"] == "pruned" and "not among the best 2 of 3" in weak["reason"] and weak["pruned_at"] >= 8
    run_dir = Path(state["trials"][by_lr["1e-06"]]["run_dir"])
    assert (run_dir / "checkpoints" / f"step-{weak['pruned_at']:06d}").is_dir()
    assert sum(t["status"] == "completed" for t in trials.values()) == 2  # 3 -> 2 at step 8
    paused = [int(Path(c).name.split("-")[1]) for c in state["trials"][by_lr["0.003"]].get("resumed_from", [])]
    assert len(paused) == 1 and 8 <= paused[0] < 16, paused  # paused after the rung, mid-run
    assert "resumed_from" not in state["trials"][by_lr["0.01"]]  # ran on: one launch
    assert (Path(state["trials"][by_lr["0.01"]]["run_dir"]) / "job.log").read_text().count("Preemption") == 0
    # paused and resumed from its checkpoint, or run on, each ends where the same trial run without a pause ends
    for lr in ("0.003", "0.01"):
        same, trial = uninterrupted["trials"][by_lr[lr]], trials[by_lr[lr]]
        assert same["status"] == "completed", (lr, same)
        assert trial["value"] == pytest.approx(same["value"], rel=1e-6, abs=0)
        assert trial["rungs"] == pytest.approx(same["rungs"], rel=1e-6)


def test_equal_token_trials_take_steps_in_inverse_proportion_to_their_batch(tmp_path: Path) -> None:
    """A batch-size study at equal data: the trial of twice the batch takes half the steps, validates and meets
    the rung at the same tokens (its step 4 is the config's step 8), and its learning-rate schedule spans its
    own steps."""
    args = _study(tmp_path, "tokens", "study.kind=hparams", "study.pruner=none", "study.equal_tokens=true")
    assert main([*args, "data.global_batch_size=8,16", "module.warmup_steps=4"]) == 0
    state = json.loads((tmp_path / "tokens" / "study.json").read_text())
    seen = {}
    for trial in state["trials"].values():
        assert trial["status"] == "completed" and set(trial["rungs"]) == {"8"}, trial
        results = json.loads(Path(trial["results"]).read_text())
        batch = results["global_batch_size"]
        seen[batch] = results["global_step"] * batch * results["seq_len"]
        job = (Path(trial["run_dir"]) / "job.log").read_text()
        assert f"validation at step {64 // batch} " in job, job[-2000:]  # the rung read off its own step
        assert ("validation at step 4 " in job) == (batch == 16)
        config = (Path(trial["run_dir"]) / "resolved_config.yaml").read_text()
        assert f"warmup_steps: {32 // batch}\n" in config and f"max_steps: {128 // batch}\n" in config
    assert seen == {8: 16 * 8 * 64, 16: 16 * 8 * 64}, seen


def _study_processes(driver: int) -> list[int]:
    """Processes of the jobs a driver started (their environment names the driver's pid)."""
    mark = f"LIGHTNING_SCALE_SWEEP_JOB={driver}-".encode()
    alive = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if any(v.startswith(mark) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")):
                    alive.append(int(pid))
            except OSError:
                pass
    return alive


def test_a_driver_killed_mid_study_and_rerun_runs_nothing_twice_and_ends_as_an_uninterrupted_one(
    hparams: tuple[Path, dict[str, Any]],
) -> None:
    tmp, uninterrupted = hparams
    args = _study(tmp, "killed", "study.kind=hparams", "study.pruner=median", PAIR)
    command = [sys.executable, "-m", "lightning_scale.cli.study", *args]
    state_file = tmp / "killed" / "study.json"
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # until the second trial trains
        state = json.loads(state_file.read_text()) if state_file.exists() else {"trials": {}}
        running = [t for t in state["trials"].values() if t["status"] == "running" and t.get("order") == 1]
        if running and "step 2/" in (Path(running[0]["run_dir"]) / "job.log").read_text(errors="replace"):
            break
        time.sleep(0.2)
    else:
        driver.kill()
        pytest.fail(f"the second trial never started: {driver.communicate()[0].decode()[-3000:]}")
    assert _study_processes(driver.pid)
    first = next(t for t in state["trials"].values() if t.get("order") == 0)
    finished = (Path(first["run_dir"]) / "results.json").read_bytes()
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    time.sleep(2.0)
    assert _study_processes(driver.pid) == []  # no orphan 2 s after the kill

    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"{first['name']}: completed earlier; not run again" in rerun.stdout
    assert (Path(first["run_dir"]) / "results.json").read_bytes() == finished  # never rewritten
    resumed = _report(tmp, "killed")
    assert resumed["winner"].startswith("learning_rate-0.003")  # as in the uninterrupted study, of these two
    for name, again in resumed["trials"].items():  # the first two of the uninterrupted study's three
        trial = uninterrupted["trials"][name]
        assert (again["status"], again["value"], again["rungs"]) == (trial["status"], trial["value"], trial["rungs"])


def test_a_layout_study_calibrates_on_its_first_runs_and_reranks_every_layout(tmp_path: Path) -> None:
    space = (
        "study.space={activation_checkpointing:[none],data_parallel_mode:[ddp],schedule:[1f1b],microbatches:[null,4]}"
    )
    price = "callbacks.cost.price_per_device_hour=2.0"
    assert main(_study(tmp_path, "layouts", "study.k=2", "study.max_rounds=1", "study.pruner=none", space, price)) == 0
    state = json.loads((tmp_path / "layouts" / "study.json").read_text())
    report = _report(tmp_path, "layouts")
    before, after = state["predicted_before"], state["predicted_after"]
    assert len(before) >= 3 and set(after) == set(before)  # every layout predicted again after calibration
    ran = {n for n, t in state["trials"].items() if t["status"] == "completed"}
    assert len(ran) >= 2
    first = state["first_round"]  # the planner's fastest, and the layout that adds most to the fit
    assert len(first) == 2 and first[0] == max(before, key=before.__getitem__) and set(first) <= set(state["trials"])
    # after calibration the predictions of the runs it fitted are near what they measured (not 3x off)
    for name in ran:
        assert 0.5 < after[name] / state["trials"][name]["value"] < 2.0, (name, after[name], state["trials"][name])
    measured = {n: state["trials"][n]["value"] for n in ran}
    assert report["winner"] == max(measured, key=measured.__getitem__)
    assert state["rounds"] and state["rounds"][-1]["measured_best"] == report["winner"]
    cost = report["cost"]
    assert cost["device_s"] > 0 and cost["usd"] == pytest.approx(cost["device_hours"] * 2.0)
    assert report["grid"]["trials"] == len(before) and 0 < report["cost_vs_grid"] <= 1.0
    assert (tmp_path / "layouts" / "study.png").stat().st_size > 0


def test_a_study_stops_when_its_budget_is_spent(tmp_path: Path) -> None:
    args = _study(tmp_path, "budget", "study.kind=hparams", "study.pruner=none", GRID, "study.budget_gpu_hours=0.004")
    main(args)
    trials = _report(tmp_path, "budget")["trials"]
    statuses = [t["status"] for t in trials.values()]
    stopped = [t for t in trials.values() if t["status"] == "pruned"]
    assert stopped and "budget" in stopped[0]["reason"]
    assert statuses.count("skipped") >= 1
    assert all("budget" in t["reason"] for t in trials.values() if t["status"] == "skipped")
