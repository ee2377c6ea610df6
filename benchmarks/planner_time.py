"""The planner's step time against runs measured on this machine, after calibrating from three of them.

    python benchmarks/planner_time.py [--steps 30] [--repeats 3] [--workdir DIR]
    python benchmarks/planner_time.py --from-workdir DIR    # the same figures from a study's stored runs

Runs ``lightning-scale-train`` (the tiny GPT, Shakespeare, gloo on CPU, one thread per process) at
12 layouts on 2 and 4 processes (data parallel as ddp, fsdp and fsdp_grad_op, tensor, pipeline with
1F1B, GPipe and interleaved 1F1B at several micro-batch counts, activation checkpointing, and their
products), each run recording the planner's inputs beside its measured step time in ``results.json``.
Then ``lightning-scale-plan calibrate`` fits this machine's factors to :data:`CALIBRATE_FROM` (three
runs), and the calibrated planner predicts the other nine: ``time_error_mean`` (mean absolute relative
error of the step time), ``spearman`` (rank correlation of predicted and measured step times). Last,
``strategy=auto`` runs on 4 processes with that calibration: ``auto_vs_best`` is its tokens/s over the
best 4-process layout's (1.0: it found the best; the acceptance is >= 0.9), ``auto_layout`` what it chose.

With ``--repeats N`` every configuration runs N times, round-robin (all of them once, then all again), so
a loaded spell of a shared machine slows every configuration alike instead of a few; a configuration's
measured step time and tokens/s are the medians of its runs, calibration fits all the runs of its three
configurations, and each row records the spread and the load average during its runs. ``strategy=auto``
runs N times after the calibration (before it, it would plan with the uncalibrated defaults).

``--from-workdir DIR`` trains nothing: it recalibrates from the runs a study stored in ``DIR`` (into
``DIR/calibration-from-workdir.json``, leaving the study's own calibration as it was) and predicts them all
again with the planner as it is now, so a change of the model is judged on the same measurements.
``auto_vs_best`` is then still what the stored ``strategy=auto`` runs measured (chosen by the planner of
their day); ``planner_pick`` is the 4-process layout of the study the planner now predicts fastest and
``planner_pick_vs_best`` its measured tokens/s over the best one's.

Prints ``BENCH planner_time {json}`` last (``benchmarks/planner.py`` folds it into ``BENCH planner``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning_scale.cli.plan_calibrate import calibrate, observations_in
from lightning_scale.core.planner.calibration import load_calibration
from lightning_scale.core.planner.step_time import estimate_time

RESULTS = Path(__file__).resolve().parent / "results"

CONFIGS: dict[str, tuple[int, list[str]]] = {
    "dp2": (2, []),
    "fsdp2": (2, ["strategy.data_parallel_mode=fsdp"]),
    "tp2": (2, ["strategy.tensor_parallel=2"]),
    "pp2-1f1b-m4": (2, ["strategy.pipeline_parallel=2", "strategy.microbatches=4"]),
    "pp2-gpipe-m8": (2, ["strategy.pipeline_parallel=2", "strategy.schedule=gpipe", "strategy.microbatches=8"]),
    "dp2-ac": (2, ["strategy.activation_checkpointing=full"]),
    "dp4": (4, []),
    "fsdp_grad_op4": (4, ["strategy.data_parallel_mode=fsdp_grad_op"]),
    "dp2-tp2": (4, ["strategy.tensor_parallel=2"]),
    "tp2-pp2": (4, ["strategy.tensor_parallel=2", "strategy.pipeline_parallel=2", "strategy.microbatches=4"]),
    "dp2-pp2": (4, ["strategy.pipeline_parallel=2", "strategy.microbatches=4"]),
    "dp2-pp2-interleaved": (
        4,
        ["strategy.pipeline_parallel=2", "strategy.schedule=interleaved_1f1b", "strategy.microbatches=4"],
    ),
}
"""Name -> (processes, overrides of ``strategy=hybrid``)."""

CALIBRATE_FROM = ("dp2", "tp2", "pp2-gpipe-m8")
"""Three runs that separate the three fitted factors: one bound by its matmuls (compute), one by its
tensor-parallel collectives (framework_collectives, on a CPU host), one by its many small micro-batches
(overhead). Calibrating on a 4-process pipeline instead (dp2-pp2) left the factors confounded: 41% mean
error on the others (the planner of 2026-12-03)."""


def _train(name: str, devices: int, overrides: list[str], workdir: Path, steps: int, env: dict[str, str]) -> Path:
    run_dir = workdir / name
    if (run_dir / "results.json").exists():
        return run_dir
    command = [
        sys.executable,
        "-m",
        "lightning_scale.cli.train",
        "model=tiny",
        f"trainer.devices={devices}",
        f"trainer.max_steps={steps}",
        f"trainer.log_every_n_steps={steps // 3}",
        "trainer.limit_val_batches=0",
        "validate_before_fit=false",
        "validate_after_fit=false",
        "callbacks=[throughput,step_time]",
        "logger=none",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    load = os.getloadavg()[0]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    (run_dir / "load.json").write_text(json.dumps({"before": load, "after": os.getloadavg()[0]}))
    return run_dir


def _runs(
    configs: dict[str, tuple[int, list[str]]], workdir: Path, steps: int, repeats: int, env: dict[str, str]
) -> dict[str, list[Path]]:
    """Every configuration ``repeats`` times, round-robin; each name's run folders (``NAME`` or ``NAME-rK``)."""
    dirs: dict[str, list[Path]] = {name: [] for name in configs}
    for r in range(repeats):
        for name, (devices, overrides) in configs.items():
            folder = name if repeats == 1 else f"{name}-r{r}"
            dirs[name].append(_train(folder, devices, overrides, workdir, steps, env))
    return dirs


def _stored_runs(names: list[str], workdir: Path) -> dict[str, list[Path]]:
    """The run folders a study left in ``workdir`` for each name (``NAME-rK``, or ``NAME`` without repeats)."""
    dirs: dict[str, list[Path]] = {}
    for name in names:
        repeats = sorted(d for d in workdir.glob(f"{name}-r*") if d.name[len(name) + 2 :].isdigit())
        found = [d for d in (repeats or [workdir / name]) if (d / "results.json").exists()]
        if not found:
            raise ValueError(
                f"{workdir} holds no finished run of {name} ({name}/ or {name}-rK/ with a results.json); "
                "pass the --workdir of a complete study."
            )
        dirs[name] = found
    return dirs


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def time_study(
    workdir: Path,
    steps: int,
    configs: dict[str, tuple[int, list[str]]] = CONFIGS,
    repeats: int = 1,
    *,
    stored: bool = False,
) -> dict[str, Any]:
    """Run the study in ``workdir`` (or, ``stored``, read the runs a study left there) and report it."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "LIGHTNING_SCALE_PEAK_FILE": str(workdir / "peaks.json"),
        "LIGHTNING_SCALE_CALIBRATION": str(workdir / "calibration.json"),
    }
    auto = {"auto4": (4, ["strategy=auto"])}
    runs = _stored_runs([*configs, *auto], workdir) if stored else _runs(configs, workdir, steps, repeats, env)
    repeats = max(len(dirs) for dirs in runs.values())
    store = workdir / ("calibration-from-workdir.json" if stored else "calibration.json")
    for line in calibrate([d for n in CALIBRATE_FROM for d in runs[n]], store=store):
        print("calibrate:", line)
    if not stored:  # strategy=auto plans with the calibration just stored (LIGHTNING_SCALE_CALIBRATION)
        runs |= _runs(auto, workdir, steps, repeats, env)
    rows = []
    for name in configs:
        groups, _ = observations_in(runs[name])
        ((system, observations),) = groups.values()
        observation = observations[0]
        measured = statistics.median(o.step_time for o in observations)
        fitted = load_calibration(system, store)
        predicted = estimate_time(
            observation.shape,
            observation.workload,
            observation.candidate,
            system,
            fitted,
            peak=statistics.median(o.peak for o in observations),
        ).step_time
        loads = [json.loads((d / "load.json").read_text()) for d in runs[name] if (d / "load.json").exists()]
        rows.append(
            {
                "config": name,
                "processes": configs[name][0],
                "layout": observation.candidate.name,
                "measured_s": measured,
                "measured_runs_s": [o.step_time for o in observations],
                "predicted_s": predicted,
                "error": predicted / measured - 1,
                "load_average": [round(v, 2) for x in loads for v in (x["before"], x["after"])],
                "calibration_run": name in CALIBRATE_FROM,
            }
        )
        print(
            f"time {name:22s} {observation.candidate.name:36s} measured {measured:.4f} s "
            f"({', '.join(f'{o.step_time:.3f}' for o in observations)}), predicted {predicted:.4f} s, error "
            f"{rows[-1]['error']:+.3f}{' (calibrated on)' if name in CALIBRATE_FROM else ''}"
        )
    held = [r for r in rows if not r["calibration_run"]]

    def rate(name: str) -> float:
        return statistics.median(json.loads((d / "results.json").read_text())["tokens_per_sec"] for d in runs[name])

    autos = [json.loads((d / "results.json").read_text()) for d in runs["auto4"]]
    four = {n: rate(n) for n, (d, _) in configs.items() if d == 4}
    best = max(four, key=four.__getitem__)
    pick = min((r for r in rows if r["processes"] == 4), key=lambda r: r["predicted_s"])["config"]
    report = {
        "time_error_mean": statistics.fmean(abs(r["error"]) for r in held),
        "time_error_max": max(abs(r["error"]) for r in held),
        "time_cases": len(held),
        "repeats": repeats,
        "spearman": _spearman([r["predicted_s"] for r in held], [r["measured_s"] for r in held]),
        "auto_layout": sorted({a["planner"]["layout"] for a in autos}),
        "auto_vs_best": rate("auto4") / four[best],
        "best_4_process": best,
        "planner_pick": pick,
        "planner_pick_vs_best": four[pick] / four[best],
        "auto_predicted_step_error": statistics.median(a["planner"]["error"].get("step_time_s") for a in autos),
        "calibrated_on": list(CALIBRATE_FROM),
        "rows": rows,
    }
    print(
        f"auto: {report['auto_layout']} at {rate('auto4'):.0f} tokens/s; the best measured 4-process layout {best} "
        f"{four[best]:.0f} tokens/s (ratio {report['auto_vs_best']:.3f})"
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration, round-robin (median)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument(
        "--from-workdir",
        type=Path,
        default=None,
        help="train nothing: recalibrate and predict from the runs a study stored in this folder",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the report goes (default "
        "benchmarks/results/planner_time.json; with --from-workdir DIR/planner_time-from-workdir.json)",
    )
    args = parser.parse_args()
    if args.from_workdir is not None:
        if not args.from_workdir.is_dir():
            parser.error(
                f"--from-workdir {args.from_workdir} is not a directory; pass the --workdir of a finished study."
            )
        try:
            report = time_study(args.from_workdir, args.steps, stored=True)
        except ValueError as err:
            parser.error(str(err))
    else:
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="planner-time-"))
        workdir.mkdir(parents=True, exist_ok=True)
        report = time_study(workdir, args.steps, repeats=args.repeats)
    from _common import emit

    default = (
        RESULTS / "planner_time.json"
        if args.from_workdir is None
        else args.from_workdir / "planner_time-from-workdir.json"
    )
    emit("planner_time", report, args.out or default)


if __name__ == "__main__":
    main()
