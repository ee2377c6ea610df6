"""The README's main job against the same job under Lightning's ``DDPStrategy``, as a new user runs them.

    python benchmarks/quickstart.py                       # 3 rounds of 4 runs of the default job (~15 min on 2 cores)
    python benchmarks/quickstart.py --rounds 5 --max-steps 100

Each round runs ``lightning-scale-train`` (the default job: ``HybridParallelStrategy``, dp=2 on CPU) and
``lightning-scale-train strategy=ddp`` (Lightning's ``DDPStrategy`` on the same model, data and callbacks)
alternately, each once with ``OMP_NUM_THREADS`` unset, as the README leaves it, and once exported as 1,
the setting every test and the other benchmarks use; the order rotates every round. Issue 39 found the
default job 2-4x slower than DDP with the variable unset (every rank but the launcher's at one thread per
core: oversubscribed), at parity with it set.

A step's time is ``train/step_time/total`` as the run logged it (``csv/metrics.csv``; the first logged
window dropped as warm-up when there are more); each variant's median over its rounds. Ratios:
``hybrid_vs_ddp_unset`` and ``hybrid_vs_ddp_omp1`` (the peer; target <= 1.02 for both) and
``unset_vs_omp1`` (the default job without the variable against it exported: the best thread setting
on this host is the bound). ``quickstart_wall_s``: the first round's default job, start to exit, as
the README runs it (no argument but the run directory, ``OMP_NUM_THREADS`` unset; with ``--max-steps``,
the shortened job's). Each rank's thread
count is in ``threads_per_process`` (``results.json``).

Prints ``BENCH quickstart {json}`` last and writes benchmarks/results/quickstart.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, emit

VARIANTS = (("hybrid", "unset"), ("ddp", "unset"), ("hybrid", "omp1"), ("ddp", "omp1"))
TRAIN = [sys.executable, "-m", "lightning_scale.cli.train"]


def _env(threads: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    if threads == "omp1":
        env["OMP_NUM_THREADS"] = "1"
    return env


def step_times(metrics: Path) -> list[float]:
    """Every logged ``train/step_time/total`` of a run, in order."""
    with metrics.open() as f:
        return [float(row["train/step_time/total"]) for row in csv.DictReader(f) if row.get("train/step_time/total")]


def run_job(strategy: str, threads: str, run_dir: Path, max_steps: int | None, extra: list[str]) -> dict[str, Any]:
    """One run of the default job (``strategy=ddp``: under Lightning's DDPStrategy); its median step time."""
    overrides = [f"hydra.run.dir={run_dir}", *extra]
    if strategy == "ddp":
        overrides.append("strategy=ddp")
    if max_steps is not None:
        overrides.append(f"trainer.max_steps={max_steps}")
    start = time.monotonic()
    proc = subprocess.run([*TRAIN, *overrides], env=_env(threads), capture_output=True, text=True, check=False)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{strategy}/{threads} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    times = step_times(run_dir / "csv" / "metrics.csv")
    if not times:
        raise RuntimeError(f"{strategy}/{threads}: no train/step_time/total in {run_dir / 'csv' / 'metrics.csv'}")
    kept = times[1:] if len(times) > 1 else times
    results = json.loads((run_dir / "results.json").read_text())
    return {
        "step_s": statistics.median(kept),
        "wall_s": wall,
        "threads_per_process": results.get("threads_per_process"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=None, help="default: the default job's own (300)")
    parser.add_argument("--out", type=Path, default=RESULTS / "quickstart.json")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (e.g. trainer.limit_val_batches=1)")
    args = parser.parse_args()
    if args.rounds < 1:
        raise ValueError(f"--rounds={args.rounds}: at least one round is needed; pass --rounds 3 or more.")
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    scratch = Path(tempfile.mkdtemp(prefix="quickstart-bench-"))
    load_start = os.getloadavg()[0]
    try:
        for r in range(args.rounds):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for strategy, threads in order:
                run = run_job(strategy, threads, scratch / f"{strategy}-{threads}-{r}", args.max_steps, args.overrides)
                runs[(strategy, threads)].append(run)
                print(f"round {r} {strategy:6s} OMP {threads:5s}: {run['step_s']:.3f} s/step, {run['wall_s']:.0f} s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def median(strategy: str, threads: str) -> float:
        return statistics.median(run["step_s"] for run in runs[(strategy, threads)])

    report = {
        "rounds": args.rounds,
        "max_steps": args.max_steps or 300,
        "overrides": args.overrides,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": load_start,
        **{f"{s}_step_s_{t}": median(s, t) for s, t in VARIANTS},
        "hybrid_vs_ddp_unset": median("hybrid", "unset") / median("ddp", "unset"),
        "hybrid_vs_ddp_omp1": median("hybrid", "omp1") / median("ddp", "omp1"),
        "unset_vs_omp1": median("hybrid", "unset") / median("hybrid", "omp1"),
        "quickstart_wall_s": runs[("hybrid", "unset")][0]["wall_s"],
        "threads_per_process": {f"{s}_{t}": runs[(s, t)][0]["threads_per_process"] for s, t in VARIANTS},
    }
    emit("quickstart", report, args.out)


if __name__ == "__main__":
    main()
