"""A self-steering study against the full grid it replaces, on this machine.

    python benchmarks/study.py                      # both parts (about 25 minutes on 2 cores)
    python benchmarks/study.py --parts layouts      # or hparams

- ``layouts``: ``lightning-scale-study`` on the reference GPT (tiny), 4 gloo processes, every layout of
  :data:`LAYOUT_SPACE` the planner says fits (>= 8), ``--layout-steps`` steps each: the planner's top
  ``--k`` run, calibrate it, it re-ranks, the new leaders run, a median pruner on tokens/s at half the
  steps. Then the grid: every one of those layouts run to the end (``study.k`` = all of them, no pruner).
  ``found_best``: 1 when the study's winner, as the grid measured it, is the grid's best or within 5% of its
  tokens/s; ``cost_vs_grid``: the study's device-seconds over the grid's; ``calibrated_rank_spearman``: the
  rank correlation of the study's calibrated predictions (every layout, after its last calibration) with
  the grid's measured tokens/s.
- ``hparams``: learning rate x global batch size (:data:`HPARAMS`, 9 trials, 2 processes, ``--hp-steps``
  steps, validation every ``--hp-val-every``): successive halving (eta 3) on validation loss, against the
  grid of every trial to the end: ``hp_val_loss_gap`` (the study's best over the grid's best, minus one;
  target <= 0.02) and ``hp_cost_vs_grid`` (target <= 0.5). ``--hp-rungs`` sets the rungs (default: successive
  halving's schedule, :func:`lightning_scale.cli.study.halving_rungs`), ``--hp-rung-tolerance`` its
  ``study.rung_tolerance``, ``--hp-set`` a training override for both; ``--hp-equal-tokens`` runs study and
  grid at equal data (``study.equal_tokens=true``: a trial of twice the batch takes half the steps).

Device-seconds are each job's wall time (its processes' start included) times its processes. The two
studies of a part run one after the other on an otherwise idle machine. Prints ``BENCH study {json}`` last
and writes benchmarks/results/study.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, emit
from planner_time import _spearman

LAYOUT_SPACE = "study.space={activation_checkpointing:[none],schedule:[1f1b],data_parallel_mode:[ddp,fsdp],microbatches:[null,2,4,8]}"
HPARAMS = ["module.learning_rate=1e-3,3e-3,1e-2", "data.global_batch_size=8,16,32"]
"""The default grid (``--hp-lr``, ``--hp-batch`` give others)."""


REUSE: set[str] = set()
"""Studies (``grid``, ``hparams_grid``) whose stored result in the work directory is read instead of run again
(``--reuse-grids``: a change of the study driver judged against the same grid measurements)."""


def _study(workdir: Path, name: str, args: list[str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "lightning_scale.cli.study", f"study.dir={workdir}", f"study.name={name}", *args]
    start = time.monotonic()
    if name in REUSE and (workdir / name / "study_report.json").exists():
        print(f"{name}: the stored study in {workdir / name} (--reuse-grids)", flush=True)
    else:
        proc = subprocess.run(command, capture_output=True, text=True)
        print(proc.stdout[-4000:], flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], flush=True)
    report = json.loads((workdir / name / "study_report.json").read_text())
    state = json.loads((workdir / name / "study.json").read_text())
    return {"report": report, "state": state, "wall_s": time.monotonic() - start}


def layouts(workdir: Path, steps: int, k: int) -> dict[str, Any]:
    common = [
        "trainer.devices=4",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=5",
        "callbacks.console.every_n_steps=5",
        "validate_before_fit=false",
        LAYOUT_SPACE,
    ]
    study = _study(workdir, "layouts", [*common, f"study.k={k}", "study.pruner=median"])
    n = len(study["state"]["predicted_before"])
    grid = _study(workdir, "grid", [*common, f"study.k={n}", "study.pruner=none", "study.max_rounds=1"])
    # The grid's measurements under the study's names for the same layouts (matched by their overrides).
    name_of = {tuple(sorted(o)): n for n, o in study["state"]["candidates"].items()}
    measured = {
        name_of[tuple(sorted(t["overrides"]))]: t["value"]
        for t in grid["state"]["trials"].values()
        if t["status"] == "completed" and t["value"] and tuple(sorted(t["overrides"])) in name_of
    }
    best = max(measured, key=measured.__getitem__)
    winner = study["report"]["winner"]
    predicted = study["state"]["predicted_after"]
    names = sorted(set(measured) & set(predicted))
    spent, grid_spent = study["report"]["cost"]["device_s"], grid["report"]["cost"]["device_s"]
    return {
        "layouts": n,
        "layouts_run": sum(t["status"] != "pending" for t in study["state"]["trials"].values()),
        "pruned": sorted(name for name, t in study["state"]["trials"].items() if t["status"] == "pruned"),
        "winner": winner,
        "grid_best": best,
        "winner_vs_best": measured.get(winner, 0.0) / measured[best],
        "found_best": int(measured.get(winner, 0.0) >= 0.95 * measured[best]),
        "cost_vs_grid": spent / grid_spent,
        "cost_bound_vs_grid": 1 / n,  # the bound: run only the best layout, known in advance
        "study_device_s": spent,
        "grid_device_s": grid_spent,
        "calibrated_rank_spearman": _spearman([predicted[x] for x in names], [measured[x] for x in names]),
        "uncalibrated_rank_spearman": _spearman(
            [study["state"]["predicted_before"][x] for x in names], [measured[x] for x in names]
        ),
        "measured_tokens_per_sec": measured,
        "predicted_after": {x: predicted[x] for x in names},
        "first_round": study["state"].get("first_round"),
        "rounds": study["state"]["rounds"],
    }


def hparams(
    workdir: Path,
    steps: int,
    val_every: int,
    axes: list[str],
    name: str = "hparams",
    *,
    rungs: str | None = None,
    equal_tokens: bool = False,
    rung_tolerance: float | None = None,
) -> dict[str, Any]:
    common = [
        "trainer.devices=2",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={val_every}",
        "trainer.limit_val_batches=8",
        "validate_before_fit=false",
        "study.kind=hparams",
        *([f"study.rungs=[{rungs}]"] if rungs else []),
        *(["study.equal_tokens=true"] if equal_tokens else []),
        *axes,
    ]
    tolerance = [f"study.rung_tolerance={rung_tolerance}"] if rung_tolerance is not None else []
    study = _study(workdir, name, [*common, "study.pruner=successive_halving", "study.eta=3", *tolerance])
    grid = _study(workdir, f"{name}_grid", [*common, "study.pruner=none"])

    def best(run: dict[str, Any]) -> tuple[str, float]:
        done = {n: t["value"] for n, t in run["state"]["trials"].items() if t["status"] == "completed"}
        name = min(done, key=done.__getitem__)
        return name, done[name]

    (s_name, s_loss), (g_name, g_loss) = best(study), best(grid)
    return {
        "hp_trials": len(grid["state"]["trials"]),
        "hp_equal_tokens": equal_tokens,
        "hp_rungs": rungs or "the study's default",
        "hp_rung_tolerance": study["state"]["options"]["rung_tolerance"],
        "hp_pruned": sum(t["status"] == "pruned" for t in study["state"]["trials"].values()),
        "hp_winner": s_name,
        "hp_grid_best": g_name,
        "hp_val_loss_gap": s_loss / g_loss - 1,
        "hp_cost_vs_grid": study["report"]["cost"]["device_s"] / grid["report"]["cost"]["device_s"],
        "hp_cost_bound_vs_grid": 1 / len(grid["state"]["trials"]),  # only the best trial, known in advance
        "hp_study_device_s": study["report"]["cost"]["device_s"],
        "hp_grid_device_s": grid["report"]["cost"]["device_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="layouts,hparams")
    parser.add_argument("--layout-steps", type=int, default=40)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--hp-steps", type=int, default=300)
    parser.add_argument("--hp-val-every", type=int, default=50)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the studies here (default: a temporary one)")
    parser.add_argument("--hp-lr", default=HPARAMS[0].split("=")[1], help="learning rates, comma-separated")
    parser.add_argument("--hp-batch", default=HPARAMS[1].split("=")[1], help="global batch sizes, comma-separated")
    parser.add_argument("--hp-name", default="hparams", help="the hyper-parameter studies' names (name, name_grid)")
    parser.add_argument("--hp-rungs", default=None, help="successive halving's rungs, comma-separated steps")
    parser.add_argument(
        "--hp-set",
        action="append",
        default=[],
        help="a training override for study and grid (e.g. module.warmup_steps=32)",
    )
    parser.add_argument(
        "--hp-rung-tolerance", type=float, default=None, help="study.rung_tolerance (default: the study's, 0)"
    )
    parser.add_argument(
        "--hp-equal-tokens", action="store_true", help="every trial on the same tokens (study.equal_tokens=true)"
    )
    parser.add_argument(
        "--reuse-grids", action="store_true", help="read the grids stored in --workdir instead of running them again"
    )
    args = parser.parse_args()
    if args.reuse_grids:
        REUSE.update({"grid", f"{args.hp_name}_grid"})
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="study-bench-"))
    os.environ.setdefault("WANDB_MODE", "offline")
    report: dict[str, Any] = {"cpu_count": os.cpu_count()}
    parts = args.parts.split(",")
    if "layouts" in parts:
        report.update(layouts(workdir, args.layout_steps, args.k))
    if "hparams" in parts:
        axes = [*args.hp_set, f"module.learning_rate={args.hp_lr}", f"data.global_batch_size={args.hp_batch}"]
        report.update(
            hparams(
                workdir,
                args.hp_steps,
                args.hp_val_every,
                axes,
                args.hp_name,
                rungs=args.hp_rungs,
                equal_tokens=args.hp_equal_tokens,
                rung_tolerance=args.hp_rung_tolerance,
            )
        )
    emit("study", report, RESULTS / "study.json")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
