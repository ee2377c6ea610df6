"""Scaling studies: `lightning-scale-train -m` over multi-process jobs (basic and submitit_local
launchers), one wandb run per job, results.json, resumable sweeps, and `lightning-scale-report`."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.lightning import SlowSteps
from helpers.wandb_files import offline_runs
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import MissingConfigException

from lightning_scale.cli import report as report_cli
from lightning_scale.cli.environment import RESOLVED_CONFIG_ENV
from lightning_scale.cli.job_config import LayoutNotAdmitted, layout_of, preflight
from lightning_scale.cli.report import METRICS, PALETTE, build_report

SHORT = [
    "trainer.val_check_interval=5",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=5",
    "logger=[csv,wandb]",
]


def _executable(name: str) -> str:
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    assert found, f"{name} is not installed (pip install -e .)"
    return found


def _env(cache: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", RESOLVED_CONFIG_ENV, "WANDB_DIR")
    }
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true", LIGHTNING_SCALE_CACHE=str(cache))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))  # helpers.*
    return env


def _check_mfu(r: dict[str, Any]) -> None:
    """A job's MFU is its achieved FLOP/s over the CPU peak measured for the study, or absent when a loaded
    machine measured that peak below what the model then ran at (not utilisation: never logged above 1)."""
    achieved, peak = r["metrics"]["train/achieved_tflops_per_device"] * 1e12, r["metrics"]["train/peak_flops_measured"]
    if r["mfu"] is None:
        assert achieved > peak, r
    else:
        assert 0 < r["mfu"] == pytest.approx(achieved / peak, rel=0.05), r


def _sweep(cwd: Path, cache: Path, *args: str, timeout: float = 400, **popen: Any) -> subprocess.CompletedProcess[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    command = [_executable("lightning-scale-train"), "-m", *args]
    return subprocess.run(
        command, cwd=cwd, env=_env(cache), capture_output=True, text=True, timeout=timeout, check=False
    )


def _study_dir(cwd: Path) -> Path:
    studies = [p for p in (cwd / "multirun").iterdir() if p.is_dir()]
    assert len(studies) == 1, studies
    return studies[0]


def _job_dirs(study: Path) -> list[str]:
    return sorted(
        (p.name for p in study.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "report"), key=int
    )


def _results(study: Path) -> dict[str, dict[str, Any]]:
    return {name: json.loads((study / name / "results.json").read_text()) for name in _job_dirs(study)}


def _out(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout[-4000:] + proc.stderr[-4000:]


# --- the 4-job sweep (2 processes each) with 2 layouts that do not fit -----------------------------

FOUR_JOBS = [
    "strategy=hybrid",
    "strategy.tensor_parallel=1,2,4",
    "strategy.data_parallel_mode=ddp,fsdp",
    "trainer.max_steps=10",
    "callbacks.checkpoint=null",
    *SHORT,
]


@pytest.fixture(scope="module")
def four_jobs(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> dict[str, Any]:
    cwd = tmp_path_factory.mktemp("four_jobs")
    start = time.monotonic()
    proc = _sweep(cwd, data_cache, *FOUR_JOBS)
    return {"cwd": cwd, "proc": proc, "elapsed": time.monotonic() - start}


@pytest.mark.slow
def test_each_job_starts_its_processes_once_in_its_own_directory(four_jobs: dict[str, Any]) -> None:
    proc, cwd = four_jobs["proc"], four_jobs["cwd"]
    assert proc.returncode == 0, _out(proc)  # skipped jobs are not failures
    assert (
        proc.stdout.count("Launching 6 jobs locally") + proc.stderr.count("Launching 6 jobs locally") == 1
    )  # no re-run sweep
    study = _study_dir(cwd)
    assert not (cwd / "outputs").exists() and not (cwd / "wandb").exists()  # the sweeping process ran nothing itself
    assert _job_dirs(study) == [str(i) for i in range(6)]
    results = _results(study)
    done = {k: r for k, r in results.items() if r["status"] == "completed"}
    assert len(done) == 4, {k: (r["status"], r.get("reason")) for k, r in results.items()}
    assert {r["layout"] for r in done.values()} == {"dp2-tp1-pp1", "fsdp2-tp1-pp1", "dp1-tp2-pp1", "fsdp1-tp2-pp1"}
    for name, r in done.items():
        job_dir = study / name
        log = (job_dir / "job.log").read_text()
        assert log.count("lightning-scale-train: ") == 1, log[-2000:]  # the job trained once, on 2 processes
        assert r["world_size"] == 2 and r["global_step"] == 10 and r["job"] == int(name)
        assert r["precision"] == "32-true" and r["global_batch_size"] == 16
        assert r["tokens_per_sec"] > 0 and len(r["peak_memory_bytes_per_rank"]) == 2
        _check_mfu(r)
        assert r["peak_memory_bytes"] == max(r["peak_memory_bytes_per_rank"]) > 10 * 2**20
        assert r["best_val_loss"] <= r["final_val_loss"] < 5.5  # byte-level loss starts at ln 256
        assert r["curves"]["val/loss"] and r["curves"]["train/loss"]
        assert r["resumed_from"] is None
        # The machine's load around the job, for the report's noise warning.
        assert r["load_average"]["start"] >= 0 and r["load_average"]["end"] > 0 and r["cpu_count"] >= 1
    # The study's totals: each job's elapsed time on its 2 devices.
    totals = json.loads((study / "sweep.json").read_text())["totals"]
    assert totals["jobs_run"] == 4 and totals["job_hours"] == pytest.approx(
        sum(r["elapsed_s"] for r in done.values()) / 3600
    )
    assert totals["device_hours"] == pytest.approx(2 * totals["job_hours"])
    assert "device-hours" in proc.stdout + proc.stderr
    # One layout's training equals another's (parity), so the jobs ran their own configs correctly.
    losses = [r["final_val_loss"] for r in done.values()]
    assert max(losses) - min(losses) < 1e-3, losses


@pytest.mark.slow
def test_a_layout_that_does_not_fit_is_skipped_with_the_reason(four_jobs: dict[str, Any]) -> None:
    study = _study_dir(four_jobs["cwd"])
    skipped = {k: r for k, r in _results(study).items() if r["status"] == "skipped"}
    assert len(skipped) == 2
    for name, r in skipped.items():
        assert "strategy.tensor_parallel=4" in r["overrides"]
        assert "tensor_parallel=4 = 4 does not divide the 2 processes" in r["reason"]
        assert not (study / name / "job.log").exists() and not (study / name / "wandb").exists()  # no process started
    printed = four_jobs["proc"].stdout
    assert re.search(r"\[sweep\] /\S+: 4 completed, 2 skipped, 0 failed", printed), printed[-2000:]
    sweep = json.loads((study / "sweep.json").read_text())
    assert sweep["counts"] == {"completed": 4, "skipped": 2, "failed": 0}


@pytest.mark.slow
def test_one_wandb_run_per_job_with_the_study_as_group_and_the_layout_as_job_type(four_jobs: dict[str, Any]) -> None:
    study = _study_dir(four_jobs["cwd"])
    runs = offline_runs(four_jobs["cwd"])
    assert len(runs) == 4, [r["dir"] for r in runs]  # no extra run: none from the sweeping process or other ranks
    results = _results(study)
    for run in runs:
        job = run["dir"].parent.parent.name
        assert run["dir"].parent.parent.parent == study
        assert run["group"] == study.name and run["job_type"] == results[job]["layout"]
        assert run["id"] == results[job]["wandb_run_id"]
        config = run["config"]
        assert (
            config["resolved_config"]["strategy"]["tensor_parallel"] in (1, 2)
            and config["resolved_config"]["study"] == study.name
        )
        env = config["environment"]
        assert env["world_size"] == 2 and "torch" in env["versions"] and "lightning-scale" in env["versions"]


@pytest.mark.slow
def test_the_report_of_a_real_sweep(four_jobs: dict[str, Any]) -> None:
    study = _study_dir(four_jobs["cwd"])
    assert report_cli.main([str(study), "--rank-by", "tokens_per_sec"]) == 0  # the console script's main, in-process
    md = (study / "report" / "report.md").read_text()
    assert "4 completed, 2 skipped, 0 failed" in md and "does not divide the 2 processes" in md
    for name in ("throughput_by_layout", "mfu_by_layout", "memory_per_device", "loss_curves"):
        _check_png(study / "report" / "plots" / f"{name}.png")
    # One device count (2 processes): no scaling plots, and a bar per layout, labelled by what varies.
    assert not (study / "report" / "plots" / "throughput_vs_devices.png").exists()
    assert "One device count" in md


# --- resumable sweeps, and the same sweep through submitit's local executor ------------------------

# One process per job: the kill test of issue 12 covers resuming every rank of a multi-process run.
TWO_JOBS = [
    "strategy=hybrid",
    "trainer.devices=1",
    "trainer.max_steps=4,20",
    "callbacks.checkpoint.every_n_train_steps=5",
    *SHORT,
]
# The sweep the `resumed` fixture kills: in its first run (SlowSteps.ENV set) job 1 sleeps 30 s a step after
# its first checkpoint (step 5; the hang watchdog's floor is 120 s), so the kill lands before it could commit
# another however late a loaded machine runs the test (CI once saw 0.2 s a step outrun: it resumed from step
# 20). Every other run of this command (the re-run, submitit's) goes at full speed.
SLOW = {"_target_": "helpers.lightning.SlowSteps", "after_step": 5, "seconds": 30}
KILLED_JOBS = [*TWO_JOBS, *(f"+callbacks.slow.{key}={value}" for key, value in SLOW.items())]


def _committed(job_dir: Path) -> list[Path]:
    root = job_dir / "checkpoints"
    return [p for p in root.iterdir() if (p / "manifest.json").is_file()] if root.is_dir() else []


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> dict[str, Any]:
    """The 2-job sweep killed (SIGKILL to its whole process group) once job 1 committed a checkpoint, then run again."""
    cwd = tmp_path_factory.mktemp("resumed")
    command = [_executable("lightning-scale-train"), "-m", *KILLED_JOBS]
    with open(cwd / "first.log", "w") as log:
        env = _env(data_cache) | {SlowSteps.ENV: "1"}
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                studies = list((cwd / "multirun").glob("*/1"))
                if studies and _committed(studies[0]):
                    break
                time.sleep(0.05)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    time.sleep(2.0)  # the job's ranks (in sessions of their own) notice within 0.5 s and exit; a save may commit first
    study = _study_dir(cwd)
    before = {
        "results0": (study / "0" / "results.json").read_bytes(),
        "results1": (study / "1" / "results.json").exists(),
        "checkpoints1": [p.name for p in _committed(study / "1")],
        "first_log": (cwd / "first.log").read_text()[-3000:],
    }
    again = _sweep(cwd, data_cache, *KILLED_JOBS)
    return {"cwd": cwd, "study": study, "before": before, "again": again}


@pytest.mark.slow
def test_rerunning_a_killed_sweep_skips_finished_jobs_and_resumes_the_other_in_the_same_wandb_run(
    resumed: dict[str, Any],
) -> None:
    before, again, study = resumed["before"], resumed["again"], resumed["study"]
    assert before["checkpoints1"] and not before["results1"], before  # killed mid-job, after a checkpoint
    assert again.returncode == 0, _out(again)
    assert "job 0 (dp1-tp1-pp1): finished earlier, skipped" in again.stdout
    assert (study / "0" / "results.json").read_bytes() == before["results0"]  # not re-run
    r1 = json.loads((study / "1" / "results.json").read_text())
    assert r1["status"] == "completed" and r1["global_step"] == 20
    assert r1["resumed_from"] and Path(r1["resumed_from"]).parent == study / "1" / "checkpoints"
    assert Path(r1["resumed_from"]).name in before["checkpoints1"]
    assert json.loads((study / "1" / "job.json").read_text())["attempt"] == 1
    runs0, runs1 = offline_runs(study / "0"), offline_runs(study / "1")
    assert len(runs0) == 1 and len(runs1) == 2  # the resumed job continued its run: a second offline segment
    killed, completed = runs1  # by time stamp
    assert killed["dir_id"] == completed["dir_id"] == completed["id"] == r1["wandb_run_id"] != runs0[0]["id"]
    assert completed["group"] == study.name and completed["job_type"] == "dp1-tp1-pp1"


@pytest.mark.slow
def test_a_resumed_jobs_record_covers_its_whole_run(resumed: dict[str, Any]) -> None:
    study = resumed["study"]
    r1 = json.loads((study / "1" / "results.json").read_text())
    resumed_at = json.loads((Path(r1["resumed_from"]) / "manifest.json").read_text())[
        "global_step"
    ]  # a sharded checkpoint
    assert resumed_at == SLOW["after_step"]  # the first attempt held at the step after its first checkpoint
    # The console says so too: the resumed weights' validation is at their step, not at 0 (once per attempt).
    log = (study / "1" / "job.log").read_text()
    assert log.count("validation at step 0 |") == 1 and f"validation at step {resumed_at} |" in log, log[-3000:]
    # The curves go on from the first attempt (log_every_n_steps=5, val_check_interval=5); the validation
    # before the resumed fit is at the step it resumed from, never at 0.
    assert [s for s, _ in r1["curves"]["train/loss"]] == list(range(5, 21, 5))
    val_steps = [s for s, _ in r1["curves"]["val/loss"]]
    assert (
        val_steps[:2] == [0, 5] and val_steps[-1] == 20 and val_steps == sorted(val_steps) and resumed_at in val_steps
    )
    summary = json.loads((study / "1" / "summary.json").read_text())
    assert summary["initial_val_loss"] == r1["curves"]["val/loss"][0][1] > 5.0  # the first attempt's (about ln 256)
    state = json.loads((Path(r1["resumed_from"]) / "trainer_state.json").read_text())  # a sharded checkpoint
    earlier = next(v for k, v in state["callbacks"].items() if "ValidationRecord" in k)["elapsed_s"]
    assert r1["elapsed_s"] > earlier > 0  # the earlier attempt's time counted
    # The loggers got the validation before the resumed fit at the resumed step, not at 0 again; the CSV
    # log keeps the first attempt's rows before it (the first validation, at 0, is that attempt's).
    import csv

    with open(study / "1" / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    val_steps_logged = [int(r["step"]) for r in rows if r.get("val/loss")]
    assert val_steps_logged == sorted(set(val_steps_logged)) and val_steps_logged[0] == 0, val_steps_logged
    assert resumed_at in val_steps_logged
    # (The killed attempt's training rows never reached the file: Lightning's CSV writer buffers them.)
    train_steps_logged = [int(r["step"]) for r in rows if r.get("train/loss")]
    assert train_steps_logged == sorted(set(train_steps_logged)), train_steps_logged
    assert r1["attempt"] == 1


@pytest.mark.slow
def test_the_same_sweep_through_submitit_local_gives_the_same_jobs_and_results(
    resumed: dict[str, Any], tmp_path: Path, data_cache: Path
) -> None:
    proc = _sweep(tmp_path, data_cache, "hydra/launcher=submitit_local", *KILLED_JOBS)
    assert proc.returncode == 0, _out(proc)
    study, reference = _study_dir(tmp_path), resumed["study"]
    assert study.name == reference.name  # the same command names the same study
    assert _job_dirs(study) == _job_dirs(reference) == ["0", "1"]
    ours, theirs = _results(study), _results(reference)
    for job in ("0", "1"):
        a, b = ours[job], theirs[job]
        assert a["status"] == b["status"] == "completed"
        # The fingerprint writes the job's directory as ${run_dir}: equal though the sweeps ran in different places.
        for key in (
            "layout",
            "global_step",
            "world_size",
            "precision",
            "global_batch_size",
            "overrides",
            "config_fingerprint",
        ):
            assert a[key] == b[key], key
        # Job 1 of the reference was killed and resumed; both train bitwise alike (fp32, same seed).
        assert a["final_val_loss"] == pytest.approx(b["final_val_loss"], abs=1e-6)
        assert len(offline_runs(study / job)) == 1


# --- a failing job does not stop the sweep ----------------------------------------------------------


@pytest.mark.slow
def test_a_failing_job_does_not_stop_the_sweep_and_the_exit_status_counts_failures(
    tmp_path: Path, data_cache: Path
) -> None:
    # Job 0 (lr=-1) fails inside its process (the module's check); the sweep goes on to job 1
    # (seq_len=512), which fails before any process starts, and job 2 (tp=4), which is skipped.
    proc = _sweep(
        tmp_path,
        data_cache,
        "strategy=hybrid",
        "trainer.devices=1",
        "trainer.max_steps=2",
        "callbacks=none",
        "logger=none",
        "module.learning_rate=-1",
        "data.seq_len=64,512",
        "strategy.tensor_parallel=1,4",
    )
    assert proc.returncode == 2, _out(proc)  # the failed jobs, not the skipped ones
    results = {tuple(r["overrides"][-2:]): r for r in _results(_study_dir(tmp_path)).values()}
    runtime = results[("data.seq_len=64", "strategy.tensor_parallel=1")]
    assert runtime["status"] == "failed" and runtime["reason"].startswith("exit code") and runtime["job"] == 0
    assert "learning_rate must be positive, got -1" in (_study_dir(tmp_path) / "0" / "job.log").read_text()
    early = results[("data.seq_len=512", "strategy.tensor_parallel=1")]
    assert early["status"] == "failed" and "exceeds the model's context" in early["reason"]
    assert results[("data.seq_len=64", "strategy.tensor_parallel=4")]["status"] == "skipped"
    assert "0 completed, 2 skipped, 2 failed" in proc.stdout


# --- experiment presets -----------------------------------------------------------------------------


def _compose(*overrides: str) -> Any:
    GlobalHydra.instance().clear()
    with initialize_config_module("lightning_scale.conf", version_base="1.3"):
        return compose("config", overrides=["run_dir=unused", *overrides], return_hydra_config=True)


def _jobs(experiment: str) -> list[tuple[list[str], Any]]:
    """The jobs a sweep preset expands to: each override list and its composed config."""
    params = _compose(f"experiment={experiment}").hydra.sweeper.params
    keys = list(params)
    grid = itertools.product(*[str(params[k]).split(",") for k in keys])
    jobs = []
    for values in grid:
        overrides = [f"{k}={v}" for k, v in zip(keys, values, strict=True)]
        jobs.append((overrides, _compose(f"experiment={experiment}", *overrides)))
    return jobs


def _admitted(cfg: Any) -> str | None:
    """The layout name, or None when the sweep would skip the job."""
    try:
        name = layout_of(cfg)["name"]
        preflight(cfg)
    except (LayoutNotAdmitted, ValueError):
        return None
    return name


def test_layout_sweep_covers_every_factorisation_the_model_admits() -> None:
    jobs = _jobs("layout_sweep")
    assert all(str(cfg.hydra.mode) == "RunMode.MULTIRUN" for _, cfg in jobs)
    admitted = sorted(n for n in (_admitted(cfg) for _, cfg in jobs) if n)
    # 4 processes: every dp x tp x pp with tp, pp in {1, 2, 4}; the tiny model (4 heads, 4 blocks) admits them all.
    assert admitted == sorted(
        ["dp4-tp1-pp1", "dp2-tp1-pp2", "dp1-tp1-pp4", "dp2-tp2-pp1", "dp1-tp2-pp2", "dp1-tp4-pp1"]
    )
    assert len(jobs) == 9  # the other 3 are skipped with the reason
    # A model with 2 heads admits no tensor_parallel=4: that job is skipped, not failed.
    ((_, cfg),) = [
        (o, c) for o, c in _jobs("layout_sweep") if o == ["strategy.tensor_parallel=4", "strategy.pipeline_parallel=1"]
    ]
    cfg.model.n_heads = 2
    with pytest.raises(LayoutNotAdmitted, match=r"tensor_parallel=4 does not divide the model's n_heads=2"):
        preflight(cfg)


@pytest.mark.parametrize(
    ("experiment", "expected"),
    [
        ("scaling_strong", [(1, 32), (2, 32), (4, 32)]),  # (devices, global batch): fixed batch
        ("scaling_weak", [(1, 8), (2, 16), (4, 32)]),  # batch grows with devices
        ("precision_sweep", [(2, 16)] * 3),
        ("microbatch_sweep", [(2, 32)] * 3),
    ],
)
def test_sweep_presets_expand_to_their_jobs(experiment: str, expected: list[tuple[int, int]]) -> None:
    jobs = _jobs(experiment)
    assert [(cfg.trainer.devices, cfg.data.global_batch_size) for _, cfg in jobs] == expected
    assert all(_admitted(cfg) for _, cfg in jobs), [o for o, cfg in jobs if not _admitted(cfg)]
    if experiment == "precision_sweep":
        assert [cfg.precision.precision for _, cfg in jobs] == ["32-true", "bf16-mixed", "fp16-mixed"]
    if experiment == "microbatch_sweep":
        assert [cfg.strategy.microbatches for _, cfg in jobs] == [2, 4, 8]


def test_an_unknown_experiment_lists_the_valid_ones() -> None:
    with pytest.raises(MissingConfigException, match=r"(?s)experiment/scaling_strongest.*layout_sweep.*scaling_strong"):
        _compose("experiment=scaling_strongest")


def test_the_slurm_launcher_preset_sizes_each_allocation_from_the_run() -> None:
    cfg = _compose("hydra/launcher=slurm", "trainer.devices=8", "trainer.num_nodes=2")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 8, 8)


# --- the report, from results a sweep would write -----------------------------------------------------


def _fake_sweep(root: Path) -> Path:
    """Five jobs: data parallel on 1, 2, 4 devices (one 4-device job slower), one skipped, one failed."""
    study = root / "multirun" / "fake-00000000"
    rows = [
        (0, "dp1-tp1-pp1", 1, 1000.0, 0.40, 2.0, 400, 2.50),
        (1, "dp2-tp1-pp1", 2, 1900.0, 0.38, 2.1, 380, 2.45),
        (2, "dp4-tp1-pp1", 4, 3500.0, 0.35, 2.3, 360, 2.40),
        (3, "dp2-tp2-pp1", 4, 2500.0, 0.25, 3.2, 250, 2.41),
    ]
    for job, layout, world, rate, mfu, usd, mib, loss in rows:
        d = study / str(job)
        d.mkdir(parents=True)
        overrides = [f"trainer.devices={world}", f"strategy.tensor_parallel={2 if job == 3 else 1}"]
        doc = {
            "status": "completed",
            "study": study.name,
            "job": job,
            "layout": layout,
            "world_size": world,
            "layout_sizes": {"dp": world // (2 if job == 3 else 1), "tp": 2 if job == 3 else 1, "pp": 1},
            "overrides": overrides,
            "precision": "bf16-mixed",
            "global_batch_size": 32,
            "tokens_per_sec": rate,
            "mfu": mfu,
            "usd_per_1m_tokens": usd,
            "peak_memory_bytes": mib * 2**20,
            "final_val_loss": loss,
            "best_val_loss": loss - 0.01,
            "curves": {
                "train/loss": [[s, 5.0 - s / 100 - job / 10] for s in range(0, 201, 50)],
                "val/loss": [[200, loss]],
            },
        }
        (d / "results.json").write_text(json.dumps(doc))
        (d / "resolved_config.yaml").write_text(
            "strategy:\n  _target_: lightning_scale.strategies.HybridParallelStrategy\n  data_parallel: auto\n"
            f"  tensor_parallel: {2 if job == 3 else 1}\n  pipeline_parallel: 1\ntrainer:\n  devices: {world}\n  num_nodes: 1\n"
        )
    for job, status, reason in ((4, "skipped", "tensor_parallel=8 does not divide"), (5, "failed", "exit code 1")):
        (study / str(job)).mkdir()
        (study / str(job) / "results.json").write_text(
            json.dumps({"status": status, "job": job, "reason": reason, "overrides": []})
        )
    return study


def _check_png(path: Path, expected: set[str] | None = None) -> list[dict[str, str]]:
    """A valid PNG whose ``Series`` chunk names the series, each of which is drawn (its colour is there)."""
    from PIL import Image

    with Image.open(path) as img:
        assert img.format == "PNG" and img.size[0] > 200 and img.size[1] > 200
        series = json.loads(img.text["Series"])
        pixels = img.convert("RGB")
        colours = {c for _, c in pixels.getcolors(maxcolors=1 << 20)}
    if expected is not None:
        assert {s["name"] for s in series} == expected, series
    for s in series:
        rgb = tuple(int(s["color"][i : i + 2], 16) for i in (1, 3, 5))
        assert rgb in colours, (path.name, s)
    return series


def test_the_report_plots_rank_and_ship_everything_it_references(tmp_path: Path) -> None:
    study = _fake_sweep(tmp_path)
    report = build_report(study, rank_by="usd_per_1m_tokens")
    plots = report.directory / "plots"
    _check_png(plots / "throughput_vs_devices.png", {"measured", "ideal"})
    assert _check_png(plots / "throughput_by_layout.png") == [{"name": "tokens_per_sec", "color": PALETTE[0]}]
    _check_png(plots / "scaling_efficiency.png", {"efficiency", "ideal"})
    for name, key in (
        ("mfu_by_layout", "mfu"),
        ("usd_per_1m_tokens_by_layout", "usd_per_1m_tokens"),
        ("memory_per_device", "peak_memory_bytes"),
    ):
        assert _check_png(plots / f"{name}.png") == [{"name": key, "color": PALETTE[0]}]
    curves = _check_png(plots / "loss_curves.png")
    assert [s["name"] for s in curves] == ["#0 dp1-tp1-pp1", "#1 dp2-tp1-pp1", "#2 dp4-tp1-pp1", "#3 dp2-tp2-pp1"]
    # Cheapest first; the skipped and failed jobs are listed apart, with why.
    assert [j["job"] for j in report.ranking] == [0, 1, 2, 3]
    md, page = report.markdown.read_text(), report.html.read_text()
    assert [j["job"] for j in build_report(study, rank_by="tokens_per_sec", out=tmp_path / "r2").ranking] == [
        2,
        3,
        1,
        0,
    ]
    assert [j["job"] for j in build_report(study, rank_by="peak_memory_bytes", out=tmp_path / "r3").ranking] == [
        3,
        2,
        1,
        0,
    ]
    rows = [line for line in md.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [r.split("|")[2].strip() for r in rows] == [
        "#0 dp1-tp1-pp1",
        "#1 dp2-tp1-pp1",
        "#2 dp4-tp1-pp1",
        "#3 dp2-tp2-pp1",
    ]
    assert "skipped**: tensor_parallel=8 does not divide" in md and "failed**: exit code 1" in md
    for target in re.findall(r"\]\(([^)]+)\)", md):
        assert (report.directory / target).is_file(), target
    references = re.findall(r"""(?:src|href)\s*=\s*['"]([^'"]+)""", page)
    assert len(references) == len(report.plots) == 7 and all(r.startswith("data:image/png;base64,") for r in references)


def test_best_writes_a_strategy_config_that_trains_with_that_layout(tmp_path: Path, data_cache: Path) -> None:
    study = _fake_sweep(tmp_path)
    report = build_report(study, rank_by="mfu", best=True)
    assert report.best_config == report.directory / "conf" / "strategy" / "best.yaml"
    assert "strategy=best" in report.best_command and str(report.directory / "conf") in report.best_command
    # Passed straight back to the CLI (job 0 won on MFU: one device; the test trains 2 steps with it).
    command = [
        *report.best_command.split()[1:],
        "trainer.max_steps=2",
        "trainer.limit_val_batches=1",
        "callbacks=none",
        "logger=none",
        f"hydra.run.dir={tmp_path / 'best'}",
    ]
    proc = subprocess.run(
        [_executable("lightning-scale-train"), *command],
        cwd=tmp_path,
        env=_env(data_cache),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, _out(proc)
    assert "HybridParallelStrategy: dp=1 x pp=1 x tp=1 on 1 processes" in proc.stdout + proc.stderr
    results = json.loads((tmp_path / "best" / "results.json").read_text())
    assert results["layout"] == "dp1-tp1-pp1" and results["global_step"] == 2


def test_report_bad_input_names_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    study = _fake_sweep(tmp_path)
    with pytest.raises(
        ValueError, match=r"--rank-by 'speed' is not a metric.*Valid: tokens_per_sec, .*usd_per_1m_tokens"
    ):
        build_report(study, rank_by="speed")
    empty = tmp_path / "empty"
    (empty / "0").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"No results.json under .*empty: this is not a sweep directory"):
        build_report(empty)
    with pytest.raises(ValueError, match=r"nowhere is not a directory"):
        build_report(tmp_path / "nowhere")
    assert report_cli.main([str(empty)]) == 2
    assert "lightning-scale-report: error: No results.json" in capsys.readouterr().err
    assert not (study / "report").exists()  # rejected before writing anything
    assert set(METRICS) >= {"tokens_per_sec", "mfu", "usd_per_1m_tokens", "peak_memory_bytes", "final_val_loss"}


def test_report_logs_its_table_and_plots_to_a_wandb_run_of_the_study(tmp_path: Path) -> None:
    study = _fake_sweep(tmp_path)
    build_report(study, use_wandb=True)
    # In this process wandb's service writes the run's records to the offline file after finish() returns
    # (it closes the file when the service lets go of the run): read it once the run record is there.
    deadline = time.monotonic() + 60
    while not ((runs := offline_runs(study / "report")) and "group" in runs[0]) and time.monotonic() < deadline:
        time.sleep(0.5)
    (run,) = runs
    assert run["group"] == study.name and run["job_type"] == "report"


# --- issue 24: sweeps that never lose a result -------------------------------------------------------

# One device per job, 4 steps, no validation inside the fit (so the run validates after it), throughput
# logged at steps 2 and 4; every logger; tp=4 does not fit one process: skipped.
LOGGERS = [
    "strategy=hybrid",
    "trainer.devices=1",
    "trainer.max_steps=4",
    "trainer.log_every_n_steps=2",
    "trainer.val_check_interval=100",
    "trainer.limit_val_batches=1",
    "callbacks.checkpoint=null",
    "validate_before_fit=false",
    "study=loggers",
]


def _tree(study: Path) -> dict[str, bytes]:
    """Every file of a study but Hydra's own records (which Hydra rewrites on every run)."""
    return {
        str(p.relative_to(study)): p.read_bytes()
        for p in sorted(study.rglob("*"))
        if p.is_file() and ".hydra" not in p.parts and p.name != "multirun.yaml"
    }


@pytest.fixture(scope="module")
def loggers_study(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> dict[str, Any]:
    """The sweep run once, then dry-run and re-run with its sweep values (and arguments) in another order."""
    cwd = tmp_path_factory.mktemp("loggers")
    timings = {}
    start = time.monotonic()
    first = _sweep(cwd, data_cache, *LOGGERS, "logger=csv,wandb,none", "strategy.tensor_parallel=1,4", timeout=300)
    timings["first"] = time.monotonic() - start
    study = cwd / "multirun" / "loggers"
    before = _tree(study) if study.is_dir() else {}
    first_results = _results(study) if study.is_dir() else {}
    start = time.monotonic()
    dry = _sweep(
        cwd,
        data_cache,
        "strategy.tensor_parallel=4,1",
        "logger=none,wandb,csv",
        *LOGGERS,
        "sweep.dry_run=true",
        timeout=120,
    )
    after_dry = _tree(study) if study.is_dir() else {}
    timings["dry"] = time.monotonic() - start
    start = time.monotonic()
    again = _sweep(cwd, data_cache, "strategy.tensor_parallel=4,1", "logger=none,wandb,csv", *LOGGERS, timeout=120)
    timings["again"] = time.monotonic() - start
    return {
        "cwd": cwd,
        "study": study,
        "first": first,
        "dry": dry,
        "again": again,
        "before": before,
        "first_results": first_results,
        "after_dry": after_dry,
        "timings": timings,
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_logger_records_throughput_mfu_and_why_when_missing(loggers_study: dict[str, Any]) -> None:
    # The run validates after the fit (no validation inside it): that validation used to empty
    # trainer.callback_metrics, so results.json had no tokens/s or MFU although the console printed them.
    first = loggers_study["first"]
    assert first.returncode == 0, _out(first)
    done = {
        next(o for o in r["overrides"] if o.startswith("logger=")): r
        for r in loggers_study["first_results"].values()
        if r["status"] == "completed"
    }
    assert set(done) == {"logger=csv", "logger=wandb", "logger=none"}, done.keys()
    for r in done.values():
        assert r["tokens_per_sec"] > 0 and r["throughput"] == "logged", r
        assert r["metrics"]["train/tokens_per_sec"] == r["tokens_per_sec"]
        _check_mfu(r)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_reordered_rerun_finds_every_job_by_its_config_and_rewrites_nothing(loggers_study: dict[str, Any]) -> None:
    study, again = loggers_study["study"], loggers_study["again"]
    assert again.returncode == 0, _out(again)
    assert again.stdout.count("finished earlier, skipped") == 3, _out(again)
    after = _tree(study)
    for name, content in loggers_study["before"].items():
        if name.endswith("results.json"):
            assert after[name] == content, name  # byte-identical: no finished job rewritten
    assert _job_dirs(study) == [str(i) for i in range(6)]  # no new directory
    for name, r in _results(study).items():  # each directory still holds its own config's job
        job = json.loads((study / name / "job.json").read_text()) if (study / name / "job.json").exists() else None
        assert r["job"] == int(name) and (job is None or job["overrides"] == r["overrides"])
    sweep = json.loads((study / "sweep.json").read_text())
    assert sweep["counts"] == {"completed": 3, "skipped": 3, "failed": 0}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_dry_run_lists_every_job_with_what_it_would_do_and_launches_nothing(loggers_study: dict[str, Any]) -> None:
    dry = loggers_study["dry"]
    assert dry.returncode == 0, _out(dry)
    assert "dry run of" in dry.stdout and "6 jobs (6 skip); nothing was launched" in dry.stdout, _out(dry)
    rows = [line for line in dry.stdout.splitlines() if re.match(r"\[sweep\]\s+\d+ skip", line)]
    assert (
        len(rows) == 6
        and sum("finished earlier" in r for r in rows) == 3
        and sum("does not divide" in r for r in rows) == 3
    )
    assert loggers_study["after_dry"] == loggers_study["before"]  # not a byte written


def _marked(mark: str) -> list[str]:
    """The processes whose environment carries ``mark`` (pid and command line)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark.encode() in (proc / "environ").read_bytes():
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name}: {cmdline[:120]}")
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_of_the_sweep_ends_every_process_of_its_job_and_a_running_job_holds_its_directory(
    tmp_path: Path, data_cache: Path
) -> None:
    from lightning_scale.cli.sweep_dirs import hold_job_dir

    mark = f"LS_TEST_SWEEP_MARK={os.getpid()}-{time.monotonic_ns()}"
    env = {**_env(data_cache), mark.split("=")[0]: mark.split("=")[1]}
    command = [
        _executable("lightning-scale-train"),
        "-m",
        "strategy=hybrid",
        "trainer.devices=2",
        "trainer.max_steps=2000",
        "trainer.log_every_n_steps=1",
        "callbacks.console.every_n_steps=1",
        "callbacks.checkpoint=null",
        "logger=wandb",
        "sweep.progress_every_s=1",
        "study=killed",
    ]
    job_dir = tmp_path / "multirun" / "killed" / "0"
    with open(tmp_path / "sweep.log", "w") as log:
        proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 200
            while time.monotonic() < deadline and proc.poll() is None:
                if re.search(
                    r"job 0 \(dp2-tp1-pp1\): step \d+/2000, loss [\d.]+", (tmp_path / "sweep.log").read_text()
                ):
                    break
                time.sleep(0.2)
            printed = (tmp_path / "sweep.log").read_text()
            assert proc.poll() is None, printed[-3000:]
            # The live status names the job's log; the job's directory is held by the sweep.
            assert f"job 0 (dp2-tp1-pp1): started; log: {job_dir / 'job.log'}" in printed, printed[-3000:]
            assert re.search(rf"step \d+/2000, loss [\d.]+.*\({re.escape(str(job_dir / 'job.log'))}\)", printed), (
                printed[-3000:]
            )
            with pytest.raises(
                ValueError, match=rf"{re.escape(str(job_dir))} is held by process {proc.pid} .*kill {proc.pid}"
            ):
                hold_job_dir(job_dir)
            assert len(_marked(mark)) >= 4, _marked(mark)  # the sweep, the torchrun agent, 2 ranks
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    time.sleep(2.0)
    assert _marked(mark) == []
    os.close(hold_job_dir(job_dir))  # the lock died with the sweep


def _documented_sweep_commands() -> list[str]:
    """Every ``lightning-scale-train`` command of the scaling-studies page (docs/scaling.md) and of the sweep
    presets' comments (continuation lines joined), without the program name."""
    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "scaling.md").read_text()
    assert page.startswith("# Scaling studies: sweeps and reports"), page[:200]
    texts = [page] + [p.read_text() for p in sorted((root / "lightning_scale" / "conf" / "experiment").glob("*.yaml"))]
    commands = []
    for text in texts:
        joined = re.sub(r"\\\n#?\s*", " ", text)
        for line in joined.splitlines():
            line = line.lstrip("#` ").strip()
            if line.startswith("lightning-scale-train ") and "--config-dir" not in line:
                commands.append(line.split("`")[0].split("  #")[0].strip().removeprefix("lightning-scale-train "))
    return list(dict.fromkeys(commands))


def _expand_multirun(args: list[str], compose: slice = slice(None)) -> tuple[list[list[str]], list[Any]]:
    """The jobs Hydra's basic sweeper makes of a command line: the real config loader (which refuses a
    sweep over Hydra's own config), the preset's ``hydra.sweeper.params`` with the command line's sweeps
    after them; then the configs of the jobs in ``compose``, as a launcher composes them. No job runs."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    args = [a for a in args if a not in ("-m", "--multirun")]
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path("pkg://lightning_scale.conf"))
    cfg = loader.load_configuration("config", args, run_mode=RunMode.MULTIRUN)
    params = [f"{k}={v}" for k, v in (cfg.hydra.sweeper.get("params") or {}).items()]
    parser = OverridesParser.create(config_loader=loader)
    (batch,) = BasicSweeper.split_arguments(parser.parse_overrides(params + list(cfg.hydra.overrides.task)), None)
    return batch, [loader.load_sweep_config(cfg, list(job)) for job in batch[compose]]


def test_the_documented_sweep_commands_compose_into_their_jobs() -> None:
    import shlex

    commands = _documented_sweep_commands()
    assert len(commands) >= 8, commands
    jobs = {}
    for command in commands:
        args = shlex.split(command)
        if any(a.startswith("hydra/launcher=") for a in args) or not re.search(
            r"-m |,|experiment=\w*(sweep|scaling)", command
        ):
            continue  # the SLURM lines need submitit's plugin (their sweep is plain overrides); single runs
        batch, configs = _expand_multirun(args, slice(0, 1))  # the first job composed: every override applies
        assert batch and configs, command
        jobs[command] = batch
    gpu = _expand_multirun(shlex.split("experiment=scaling_strong trainer=gpu trainer.devices=1,2,4,8"))[1]
    assert [(c.trainer.devices, c.trainer.accelerator, c.data.global_batch_size) for c in gpu] == [
        (d, "gpu", 32) for d in (1, 2, 4, 8)
    ]
    weak = jobs["experiment=scaling_weak trainer=gpu trainer.devices=1,2,4,8"]
    assert [[o for o in job if o.startswith("trainer.devices=")] for job in weak] == [
        [f"trainer.devices={d}"] for d in (1, 2, 4, 8)
    ]
    layouts = jobs[
        "experiment=layout_sweep trainer.devices=8 strategy.tensor_parallel=1,2,4,8 strategy.pipeline_parallel=1,2,4,8"
    ]
    assert len(layouts) == 16
    precisions = jobs["experiment=precision_sweep trainer=gpu precision=fp32,bf16,bf16_true,fp16"]
    assert [[o for o in job if o.startswith("precision=")] for job in precisions] == [
        [f"precision={p}"] for p in ("fp32", "bf16", "bf16_true", "fp16")
    ]
    assert not [c for c in commands if "hydra.sweeper.params." in c]  # Hydra refuses a sweep over its own config
    # repeat=range(3): every layout of the preset three times, once with each repeat (the jobs' overrides) ...
    batch, repeated = _expand_multirun(shlex.split("experiment=layout_sweep repeat=range(3)"), slice(0, 3))
    overrides = [dict(o.split("=", 1) for o in job) for job in batch]
    runs = [(o["strategy.tensor_parallel"], o["strategy.pipeline_parallel"], o["repeat"]) for o in overrides]
    assert len({r[:2] for r in runs}) == 9 and sorted(runs) == sorted(
        {(*r[:2], str(i)) for r in runs for i in range(3)}
    )
    # ... and it reaches the config: the first layout's three jobs, composed (a third of a second each, so not all 27).
    assert [(c.strategy.tensor_parallel, c.strategy.pipeline_parallel, c.repeat) for c in repeated] == [
        (1, 1, r) for r in range(3)
    ]


def _mixed_sweep(root: Path, *, rates: tuple[Any, Any] = (1000.0, 2000.0), throughput: str = "logged") -> Path:
    """Two completed jobs of one layout that differ in precision and global batch (job 1 is faster)."""
    from omegaconf import OmegaConf

    study = root / "multirun" / "mixed"
    for job, (precision, name, batch, rate) in enumerate(
        (("fp32", "32-true", 16, rates[0]), ("bf16", "bf16-mixed", 64, rates[1]))
    ):
        d = study / str(job)
        d.mkdir(parents=True)
        cfg = _compose(
            "strategy=hybrid", f"precision={precision}", f"data.global_batch_size={batch}", "trainer.devices=1"
        )
        task = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in ("hydra", "study")])
        OmegaConf.save(task, d / "resolved_config.yaml")
        doc = {
            "status": "completed",
            "study": "mixed",
            "job": job,
            "layout": "dp1-tp1-pp1",
            "world_size": 1,
            "layout_sizes": {"dp": 1, "tp": 1, "pp": 1},
            "precision": name,
            "global_batch_size": batch,
            "overrides": [
                "strategy=hybrid",
                f"precision={precision}",
                f"data.global_batch_size={batch}",
                "trainer.max_steps=5",
            ],
            "tokens_per_sec": rate,
            "mfu": None if rate is None else 0.1,
            "usd_per_1m_tokens": None,
            "peak_memory_bytes": 2**24,
            "final_val_loss": 2.5,
            "best_val_loss": 2.4,
            "global_step": 5,
            "log_every_n_steps": 10,
            "throughput": throughput,
        }
        (d / "results.json").write_text(json.dumps(doc))
    return study


def test_best_carries_the_precision_the_global_batch_and_every_value_that_differed(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    report = build_report(_mixed_sweep(tmp_path), rank_by="tokens_per_sec", best=True)
    best = OmegaConf.load(report.best_config)
    assert best.data.global_batch_size == 64 and best.strategy.tensor_parallel == 1 and best.trainer.devices == 1
    experiment = OmegaConf.load(report.directory / "conf" / "experiment" / "best.yaml")
    assert {"override /precision": "bf16"} in experiment.defaults and report.best_command.endswith("experiment=best")
    # Passed back as the command says, it composes the winner's run.
    cfg = _compose(f"hydra.searchpath=[file://{report.directory / 'conf'}]", report.best_command.split()[-1])
    assert (cfg.precision.precision, cfg.data.global_batch_size) == ("bf16-mixed", 64)


def test_ranking_by_a_metric_no_job_recorded_is_an_error_naming_the_recorded_ones(tmp_path: Path) -> None:
    study = _mixed_sweep(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"--rank-by usd_per_1m_tokens: no completed job recorded usd_per_1m_tokens.*"
        r"Recorded: tokens_per_sec, mfu, peak_memory_bytes, final_val_loss, best_val_loss",
    ):
        build_report(study, rank_by="usd_per_1m_tokens")
    assert report_cli.main([str(study), "--rank-by", "usd_per_1m_tokens"]) == 2
    assert not (study / "report").exists()


def test_a_sweep_too_short_to_log_throughput_says_so(tmp_path: Path) -> None:
    study = _mixed_sweep(tmp_path, rates=(None, None), throughput="no_logging_step")
    with pytest.raises(
        ValueError,
        match=r"callback was on, but no job reached a logging step \(trainer.log_every_n_steps=10; "
        r"the jobs ran 5 steps\)",
    ):
        build_report(study)
    md = build_report(study, rank_by="final_val_loss").markdown.read_text()
    assert "the throughput callback was on, but no job reached a logging step" in md and "callback was off" not in md


def test_bad_sweep_options_are_refused_before_any_job_starts() -> None:
    from omegaconf import OmegaConf

    from lightning_scale.cli.sweep import SweepSummary

    with pytest.raises(TypeError, match=r"sweep.dry_run='yes' is not a boolean. Pass sweep.dry_run=true"):
        SweepSummary().on_multirun_start(OmegaConf.create({"sweep": {"dry_run": "yes", "progress_every_s": 10}}))
    with pytest.raises(
        ValueError, match=r"sweep.progress_every_s=0 must be a number of seconds > 0 .* sweep.progress_every_s=10"
    ):
        SweepSummary().on_multirun_start(OmegaConf.create({"sweep": {"dry_run": False, "progress_every_s": 0}}))
    cfg = _compose("sweep.progress_every_s=-1")
    with pytest.raises(ValueError, match=r"sweep.progress_every_s=-1 must be"):
        SweepSummary().on_multirun_start(cfg)
