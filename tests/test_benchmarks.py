"""Benchmarks are not tests, but each must still run: a tiny smoke run checks the output format."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str, script: str, *args: str, out: Path) -> dict:
    """Run ``benchmarks/<script>`` small; returns its report after checking the BENCH line equals the JSON file."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(rf"BENCH {name} (\{{.*\}})", line)
    assert match, line
    report = json.loads(match.group(1))
    assert report == json.loads(out.read_text())
    return report


@pytest.mark.slow
def test_tensor_parallel_benchmark_prints_its_ratios(tmp_path: Path) -> None:
    report = _bench(
        "tensor_parallel",
        "tensor_parallel.py",
        "--layers",
        "1",
        "--d-model",
        "64",
        "--seq",
        "32",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--rounds",
        "1",
        out=tmp_path / "tp.json",
    )
    for key in ("ratio_vs_raw_torch", "fraction_of_bound", "speedup_vs_tp1", "comm_s_per_step"):
        assert report[key] > 0, key


@pytest.mark.slow
def test_pipeline_benchmark_prints_its_ratios(tmp_path: Path) -> None:
    report = _bench(
        "pipeline",
        "pipeline.py",
        "--layers",
        "2",
        "--d-model",
        "64",
        "--seq",
        "32",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--rounds",
        "1",
        "--microbatches",
        "2,4",
        "--no-deepspeed",
        out=tmp_path / "pp.json",
    )
    assert [r["microbatches"] for r in report["results"]] == [2, 4]
    for key in ("fraction_of_bound", "ratio_vs_raw_torch"):
        assert report[key] > 0, key
    # The three implementations train the same model on the same batch.
    assert report["results"][0]["first_loss"]["strategy"] == pytest.approx(
        report["results"][0]["first_loss"]["raw_torch"]
    )
    assert report["deepspeed_error"] == "skipped (--no-deepspeed)" and report["ratio_vs_deepspeed"] is None


@pytest.mark.slow
def test_lightning_peers_benchmark_prints_its_ratios(tmp_path: Path) -> None:
    report = _bench(
        "lightning_peers",
        "lightning_peers.py",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--seq",
        "16",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--rounds",
        "1",
        out=tmp_path / "peers.json",
    )
    for key in (
        "ratio_vs_lightning_ddp",
        "ratio_vs_lightning_model_parallel_tp",
        "ratio_vs_lightning_model_parallel_fsdp",
    ):
        assert report[key] > 0, key
    # Ours and Lightning's strategies train the same model on the same batch.
    for pair in report["pairs"].values():
        assert pair["first_loss"]["ours"] == pytest.approx(pair["first_loss"]["lightning"], rel=1e-6)


@pytest.mark.slow
def test_precision_benchmark_prints_its_ratios(tmp_path: Path) -> None:
    report = _bench(
        "precision",
        "precision.py",
        "--preset",
        "tiny",
        "--batch",
        "1",
        "--seq",
        "16",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--rounds",
        "1",
        "--threads",
        "1",
        out=tmp_path / "precision.json",
    )
    for key in ("ratio_vs_torch_gradscaler", "plugin_work_ratio_vs_torch_gradscaler", "bound_s"):
        assert report[key] > 0, key
    assert set(report["step_s"]) == {"none", "ours", "torch"} and "fp32" in report["compute"]
    assert isinstance(report["overhead_fraction"], float)


@pytest.mark.slow
def test_checkpoint_benchmark_prints_its_ratios(tmp_path: Path) -> None:
    report = _bench(
        "checkpoint",
        "checkpoint.py",
        "--layers",
        "1",
        "--d-model",
        "64",
        "--heads",
        "2",
        "--seq",
        "16",
        "--rounds",
        "2",
        "--dir",
        str(tmp_path),
        out=tmp_path / "checkpoint.json",
    )
    for key in (
        "save_fraction_of_disk",
        "load_fraction_of_disk",
        "async_block_fraction",
        "async_block_vs_memcpy",
        "save_ratio_vs_torch",
        "save_ratio_vs_dcp",
        "dcp_async_block_vs_memcpy",
    ):
        assert report[key] > 0, key
    assert not any(tmp_path.glob("ckpt-bench-*"))  # its files are cleaned up
    # The state saved: the fp32 model's state dict (the tied embedding under both of its names), and
    # AdamW's two moments and a 4-byte step for each parameter.
    from lightning_scale.models import GPT, GPTConfig

    model = GPT(GPTConfig(n_layers=1, d_model=64, n_heads=2, block_size=16, vocab_size=256))
    params = list(model.parameters())
    assert report["parameters"] == sum(p.numel() for p in params) == 66752
    assert (
        report["state_bytes"]
        == sum(4 * v.numel() for v in model.state_dict().values()) + sum(8 * p.numel() + 4 for p in params)
        == 866604
    )


def test_planner_benchmark_prints_its_errors(tmp_path: Path) -> None:
    report = _bench(
        "planner", "planner.py", "--cases", "gpt-full-fp32", "--time-steps", "0", out=tmp_path / "planner.json"
    )
    assert report["memory_cases"] == 1 and 0 <= report["memory_error_max"] <= 0.10
    assert report["narayanan_error_mean"] <= 0.15 and report["search_seconds"] <= 30 and report["search_layouts"] > 1000
    assert len(report["published_sources"]) >= 3 and report["published_error_mean"] <= 0.12
    assert report["fsdp_scaling_spread"] <= 0.15
    # One memory case measures one mechanism: the rest the planner ranks are named as untested.
    assert report["untested_ranked"] == len(report["untested"]) > 0 and "fsdp pp>1" in report["untested"]
    # The step-time study (13 runs of the CLI) was skipped: named, and null rather than a figure nobody measured.
    assert report["time_error_mean"] is report["spearman"] is report["auto_vs_best"] is None


def test_the_callbacks_benchmark_gives_each_variant_every_position_of_an_interval_once_a_cycle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What makes the interleaved comparison fair: per cycle (3 logging intervals) each variant runs as many
    # steps as an interval has, one at each position, so exactly one of them is a logging step (the last position).
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("callbacks_benchmark", ROOT / "benchmarks" / "callbacks.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for every in (1, 2, 3, 10, 50):
        interleave = bench._Interleave({}, {}, every, 0, 0)
        for cycle in range(3):
            steps = range(cycle * 3 * every, (cycle + 1) * 3 * every)
            assert {interleave.variant(k)[0] for k in steps} == {cycle}
            for variant in bench.VARIANTS:
                positions = [k % every for k in steps if interleave.variant(k)[1] == variant]
                assert sorted(positions) == list(range(every)), (every, variant, positions)
        # Consecutive steps change variant (a slow second of the machine falls on all three), and over two
        # cycles each variant follows each other one as often.
        pairs = [(interleave.variant(k)[1], interleave.variant(k + 1)[1]) for k in range(6 * every) if (k + 1) % every]
        assert all(a != b for a, b in pairs)
        assert len({pairs.count((a, b)) for a in bench.VARIANTS for b in bench.VARIANTS if a != b}) <= 1, pairs


def test_the_planner_time_study_is_recomputed_from_a_studys_stored_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--from-workdir`` trains nothing: runs whose step times the planner itself made (at known factors)
    are recalibrated and predicted back exactly, the study's own calibration left alone."""
    import dataclasses

    from lightning_scale.core.planner import Candidate, Workload, model_shape
    from lightning_scale.core.planner.calibration import planner_record
    from lightning_scale.core.planner.cluster import CPU_EFFICIENCY, cpu_cluster
    from lightning_scale.core.planner.step_time import estimate_time
    from lightning_scale.models import PRESETS

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import planner_time

    shape, workload = model_shape(PRESETS["tiny"]), Workload(16, 128, "32-true")
    truth = dataclasses.replace(CPU_EFFICIENCY, compute=0.6, overhead=3e-3, framework_collectives=3.5)
    layouts = {
        "dp2": Candidate(2, 1, 1, micro_batch=8),
        "tp2": Candidate(1, 2, 1, micro_batch=16, sequence_parallel=True),
        "pp2-gpipe-m8": Candidate(1, 1, 2, schedule="gpipe", micro_batch=2),
        "fsdp2": Candidate(2, 1, 1, dp_mode="fsdp", micro_batch=8),
        "dp4": Candidate(4, 1, 1, micro_batch=4),
        "dp2-pp2": Candidate(2, 1, 2, micro_batch=2),
        "auto4": Candidate(4, 1, 1, micro_batch=4),
    }
    for name, c in layouts.items():
        host = cpu_cluster(devices_per_node=c.world_size, peak_flops={"float32": 8e10 / c.world_size})
        step = estimate_time(shape, workload, c, host, truth).step_time
        for r in range(2):
            (tmp_path / f"{name}-r{r}").mkdir()
            (tmp_path / f"{name}-r{r}" / "results.json").write_text(
                json.dumps(
                    {
                        "status": "completed",
                        "tokens_per_sec": workload.tokens / step,
                        "planner": {
                            "layout": c.name,
                            "inputs": planner_record(shape, workload, c, host, 8e10 / c.world_size),
                            "measured": {"step_time_s": step},
                            "error": {"step_time_s": 0.0},
                        },
                    }
                )
            )
    (tmp_path / "calibration.json").write_text("{}")
    configs = {name: (c.world_size, []) for name, c in layouts.items() if name != "auto4"}
    report = planner_time.time_study(tmp_path, 0, configs, stored=True)
    assert (
        report["repeats"] == 2
        and report["time_cases"] == 3
        and report["calibrated_on"] == ["dp2", "tp2", "pp2-gpipe-m8"]
    )
    assert report["time_error_max"] < 0.01 and report["spearman"] == 1.0
    assert report["planner_pick"] == report["best_4_process"] and report["planner_pick_vs_best"] == 1.0
    assert (tmp_path / "calibration-from-workdir.json").exists() and (tmp_path / "calibration.json").read_text() == "{}"
    (tmp_path / "dp4-r0" / "results.json").unlink()
    (tmp_path / "dp4-r1" / "results.json").unlink()
    with pytest.raises(ValueError, match=r"holds no finished run of dp4 .*pass the --workdir of a complete study"):
        planner_time.time_study(tmp_path, 0, configs, stored=True)


@pytest.mark.slow
def test_callbacks_benchmark_prints_its_ratios(tmp_path: Path) -> None:
    report = _bench(
        "callbacks",
        "callbacks.py",
        "--steps",
        "16",
        "--warmup",
        "2",
        "--log-every",
        "2",
        "--rounds",
        "1",
        "--threads",
        "1",
        "--seq",
        "16",
        "--batch",
        "4",
        "--time-hooks",
        out=tmp_path / "callbacks.json",
    )
    assert set(report["step_s"]) == {"none", "ours", "lightning"} and min(report["step_s"].values()) > 0
    # 16 steps, cycles of 3 logging intervals of 2: cycle 0 starts in the warm-up, cycle 2 is cut short.
    assert report["cycles"] == 1 and report["log_every_n_steps"] == 2
    assert report["overhead_se"] is None and isinstance(report["overhead_mean"], float)  # one cycle: no spread
    assert len(report["overhead_by_round"]) == 1 and report["overhead_between_rounds_se"] is None  # one round
    assert (
        report["hooks_timed"]
        and 0 < report["hook_s_per_step"]["lightning"] < report["hook_s_per_step"]["ours"] < report["step_s"]["ours"]
    )
    assert {key.split(".")[0] for key in report["hook_us_per_step_by_hook"]} == {
        "CallbackGroup"
    }  # its records and members
    for key in ("overhead_fraction", "ratio_vs_throughput_monitor"):
        assert isinstance(report[key], float), key


@pytest.mark.slow
def test_resilience_benchmark_prints_the_watchdogs_overhead(tmp_path: Path) -> None:
    report = _bench(
        "resilience",
        "resilience.py",
        "--steps",
        "12",
        "--warmup",
        "2",
        "--rounds",
        "2",
        "--block",
        "2",
        "--seq",
        "16",
        "--batch",
        "4",
        "--processes",
        "2",
        out=tmp_path / "resilience.json",
    )
    assert len(report["overhead_by_processes"]) == 2 and isinstance(report["overhead_between_processes_se"], float)
    assert set(report["step_s"]) == {"off", "on"} and min(report["step_s"].values()) > 0
    # 12 steps in blocks of 2, the first 2 and each block's first dropped: 5 blocks a fit, alternating, 4 pairs.
    assert report["block_pairs"] == 8 and isinstance(report["overhead_fraction"], float)
    assert isinstance(report["overhead_mean"], float) and isinstance(
        report["overhead_se"], float
    )  # 2 disjoint pairs a fit
    assert (
        0 < report["hook_s_per_step"] < report["step_s"]["off"]
    )  # the heartbeats were timed, and are a part of a step
    assert report["switch"] == "both"  # the "on" steps ran the watchdog and recorded the goodput ledger
    # The strategy's own watchdog (hang_timeout="auto", no callback) was switched on: its beats were timed.
    beats = report["hook_s_by_hook"]
    assert (
        report["hang_timeout"] == "auto"
        and beats["StepWatchdog.step_started"] > 0
        and beats["StepWatchdog.entered"] > 0
    )
    assert sum(beats.values()) == pytest.approx(report["hook_s_per_step"])
    cpu = report["thread_cpu_s"]  # the training thread's own CPU a step: a part of the step, on and off
    assert set(cpu) == {"off", "on"} and all(0 < cpu[k] <= report["step_s"][k] * 1.05 for k in cpu)
    assert isinstance(report["thread_cpu_added_s"], float) and isinstance(report["thread_cpu_added_se"], float)


@pytest.mark.slow
def test_gpu_check_says_there_is_no_gpu_and_runs_its_path_on_the_cpu_when_asked(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: benchmarks/gpu_check.py measures it (see the note of the session)")
    assert _bench("gpu_check", "gpu_check.py", out=tmp_path / "none.json") == {"skipped": "no CUDA GPU"}
    report = _bench(
        "gpu_check",
        "gpu_check.py",
        "--accelerator",
        "cpu",
        "--presets",
        "tiny",
        "--steps",
        "4",
        "--warmup",
        "2",
        out=tmp_path / "cpu.json",
    )["presets"]["tiny"]
    assert report["tokens_per_sec"] > 0 and 0 < report["mfu"] < 1
    assert report["step_time"]["total"] > 0
    assert 0 < report["async_save_blocking_s"] <= report["async_save_committed_s"]
    # The planner's prediction for the same run (on a GPU also against torch.cuda.max_memory_allocated).
    assert report["planner"]["layout"] == "dp1-tp1-pp1-mb8" and report["planner"]["step_time_s"] > 0
    assert report["planner"]["problem"] is None and report["planner"]["memory_gib"] > 0
    # Every term and the inputs beside the measurement, so a GPU session calibrates from one run.
    planner = report["planner"]
    assert {"compute", "attention", "elementwise", "optimizer"} <= set(planner["time_terms"])
    assert planner["mfu"] > 0 and planner["mfu_error"] == pytest.approx(planner["mfu"] / report["mfu"] - 1)
    assert planner["inputs"]["candidate"]["dp"] == 1 and planner["memory_terms_gib"]["parameters"] > 0


@pytest.mark.slow
def test_quickstart_benchmark_prints_its_ratios(tmp_path: Path) -> None:
    report = _bench(
        "quickstart",
        "quickstart.py",
        "--rounds",
        "1",
        "--max-steps",
        "12",
        "trainer.limit_val_batches=1",
        "callbacks.checkpoint=null",
        out=tmp_path / "quick.json",
    )
    for key in ("hybrid_vs_ddp_unset", "hybrid_vs_ddp_omp1", "unset_vs_omp1", "quickstart_wall_s"):
        assert report[key] > 0, key
    # The variable unset (as the README leaves it), the default job's ranks share the cores as DDP's do.
    cores = len(os.sched_getaffinity(0))
    assert report["threads_per_process"]["hybrid_unset"] == max(1, cores // 2)
    assert report["threads_per_process"]["hybrid_omp1"] == 1


@pytest.mark.slow
def test_sync_benchmark_prints_its_ratios(tmp_path: Path) -> None:
    report = _bench(
        "sync",
        "sync.py",
        "--quick",
        "--max-steps",
        "20",
        "--every",
        "5",
        "--val-every",
        "10",
        "--runs",
        "every_step,diloco,every_step_no_link",
        out=tmp_path / "sync.json",
    )
    assert set(report["runs"]) == {"every_step", "diloco", "every_step_no_link"}
    # DiLoCo exchanges the parameters once every 5 steps; DDP the gradients (as many values) every step.
    assert report["bytes_vs_ddp"] == pytest.approx(1 / 5, rel=1e-3)
    assert report["bytes_bound_vs_ddp"] == pytest.approx(1 / 5)
    for name, run in report["runs"].items():
        assert run["final_val_loss"] > 0 and run["train_s"] > 0, name
        assert sorted({step for step, _ in run["val_curve"]}) == [0, 10, 20], name
    assert report["runs"]["every_step"]["val_loss_gap"] == 0.0
    assert report["link"] == {"bandwidth_mbps": 50.0, "latency_ms": 20.0}
    assert report["paper"]["perplexity_diloco"] == 15.02
