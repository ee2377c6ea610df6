"""Local SGD and DiLoCo against every-step DDP on the data-parallel axis, over a slow emulated link.

    python benchmarks/sync.py            # 5 runs of 600 steps, dp=2 on CPU (~14 min on 2 idle cores)
    python benchmarks/sync.py --quick    # 40 steps each, H=10: does it work at all?
    python benchmarks/sync.py --runs every_step,diloco --max-steps 300 trainer.limit_val_batches=5

Each run is ``lightning-scale-train`` as a user runs it (the reference GPT, ``model=tiny``, on the bundled
Shakespeare; ``HybridParallelStrategy`` at dp=2 on CPU, ``OMP_NUM_THREADS=1``; the same seed, so the same
initial model and batches), with ``strategy.emulated_link`` delaying every data-parallel exchange as if it
went over a link of ``--bandwidth-mbps`` and ``--latency-ms`` (default 50 Mbit/s, 20 ms: DDP's 3.4 MB of
gradients a step then take 0.57 s on the wire against about 0.11 s of compute on an idle 2-core machine,
the regime of a model's gradients over a cross-region link). The runs:

- ``every_step``: DDP, gradients all-reduced every step (the peer);
- ``diloco``: DiLoCo, H = ``--every`` inner AdamW steps, then the outer Nesterov step (lr 0.7, momentum 0.9);
- ``local_sgd``: the replicas' parameters averaged every H steps;
- ``diloco_h10``: DiLoCo with H = 10;
- ``every_step_no_link``: DDP with no emulated link (the bound: no communication cost at all).

Validation on the same held-out batches every ``--val-every`` steps (a multiple of every H, so the replicas
have just synchronised). A run's training time at a step is the sum of its logged ``train/step_time/total``
up to it (validation excluded; a local mode's blocked exchange included). Fields:

- ``bytes_vs_ddp``: DiLoCo's bytes sent per step / every-step's (target <= 1/H; ``bytes_bound_vs_ddp`` = 1/H);
- ``time_to_loss_vs_ddp``: DiLoCo's training time to reach the target validation loss / every-step's (target
  <= 0.6). The target is every-step's final validation loss x 1.02 (``--target-factor``); the time is
  interpolated linearly between the two validations around the crossing; null if a run never reaches it.
  ``time_to_half_loss_vs_ddp``: the same for every-step's validation loss at half the steps. The
  ``*_bound_vs_ddp`` fields: every-step with no link (the time no sync mode can beat at equal steps);
- ``val_loss_gap``: (DiLoCo's final validation loss - every-step's) / every-step's, at equal steps and tokens
  (target <= 0.02), beside the DiLoCo paper's own gap (``paper``: Table 2, in log-perplexity);
- ``ddp_step_vs_compute``: every-step's median step with the link over its step without (how
  communication-bound the peer is; the setting is meant to make it >= 2);
- per run (``runs``): wall time, training time, median step, final validation loss, the validation curve,
  bytes per step, exchanges, time blocked in exchanges, and each ratio; the load average at start and end.

``--warm-start W`` runs the DiLoCo paper's protocol (it starts DiLoCo from a pretrained model): every
local run resumes from every_step's checkpoint at step W (``ckpt_path``: a periodic fit from an every-step
checkpoint, the anchors starting from its model) and trains to the same last step; its curve and training
time up to W are every_step's. The gap then measures the periodic phase alone; ``bytes_vs_ddp`` is per step
of that phase (``bytes_per_step_whole_run``: over all steps, every_step's first W included).

One run of each variant, in the order above (not alternated: a run is minutes, and the emulated link's delay,
not the machine's noise, dominates the peer's time).

Prints ``BENCH sync {json}`` last and writes benchmarks/results/sync.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
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

TRAIN = [sys.executable, "-m", "lightning_scale.cli.train"]
# name -> (data_parallel_sync, H or None for "--every", emulated link on)
RUNS: dict[str, tuple[str, int | None, bool]] = {
    "every_step": ("every_step", None, True),
    "diloco": ("diloco", None, True),
    "local_sgd": ("local_sgd", None, True),
    "diloco_h10": ("diloco", 10, True),
    "every_step_no_link": ("every_step", None, False),
}
# Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models", arXiv 2311.08105v3,
# Table 2: 150M transformer on C4, 8 workers (non-i.i.d. shards), H = 500, from a model pretrained 24k steps, then
# 64k more steps. Perplexity of the data-parallel baseline with the same 8x batch, compute and data vs DiLoCo's.
PAPER = {
    "source": "Douillard et al. 2023, arXiv 2311.08105v3, Table 2",
    "setting": "150M transformer, C4, 8 workers non-iid, H=500, from a 24k-step pretrained model, +64k steps",
    "perplexity_data_parallel": 15.30,
    "perplexity_diloco": 15.02,
}
PAPER["val_loss_gap"] = math.log(PAPER["perplexity_diloco"]) / math.log(PAPER["perplexity_data_parallel"]) - 1
PAPER["perplexity_gap"] = PAPER["perplexity_diloco"] / PAPER["perplexity_data_parallel"] - 1


def overrides(name: str, args: argparse.Namespace, run_dir: Path) -> list[str]:
    mode, every, link = RUNS[name]
    out = [
        f"hydra.run.dir={run_dir}",
        f"trainer.max_steps={args.max_steps}",
        f"trainer.val_check_interval={args.val_every}",
        f"trainer.limit_val_batches={args.val_batches}",
        "trainer.log_every_n_steps=10",
        f"strategy.data_parallel_sync={mode}",
    ]
    if args.warm_start and name == "every_step":  # the checkpoint the local runs start from
        out += [
            f"callbacks.checkpoint.every_n_train_steps={args.warm_start}",
            "callbacks.checkpoint.save_top_k=-1",
            "callbacks.checkpoint.save_last=false",
            "+callbacks.checkpoint.filename='{step}'",
        ]
    else:
        out.append("callbacks.checkpoint=null")  # a save is not what is compared
    if args.warm_start and mode != "every_step":
        (found,) = (run_dir.parent / "every_step" / "checkpoints").glob(f"step={args.warm_start}*")
        out.append(f"ckpt_path='{found}'")  # (quoted: the name has an '=')
    if mode != "every_step":
        out.append(f"strategy.sync_every={every or args.every}")
    if link:
        out.append(f"strategy.emulated_link={{bandwidth_mbps:{args.bandwidth_mbps},latency_ms:{args.latency_ms}}}")
    return [*out, *args.overrides]


def _floats(rows: list[dict[str, str]], column: str) -> list[tuple[int, float]]:
    step = "trainer/global_step" if rows and "trainer/global_step" in rows[0] else "step"
    return sorted((int(float(r[step])), float(r[column])) for r in rows if r.get(column) not in (None, ""))


def _sync_stats(results: dict[str, Any], rows: list[dict[str, str]], steps: int) -> dict[str, Any]:
    """Bytes sent per step, exchanges and blocked seconds over the whole run, per process, as the run recorded
    them: results.json's record of the strategy's ``sync_stats()`` (a mapping with ``bytes_sent``), else the
    csv's last cumulative ``.../sync/bytes_total`` (never a logging window's bytes per step: the last window
    holds one exchange over 10 steps, not one over H)."""

    def record(node: Any) -> dict[str, Any] | None:
        if isinstance(node, dict):
            if isinstance(node.get("bytes_sent"), (int, float)):
                return node
            for value in node.values():
                found = record(value)
                if found is not None:
                    return found
        return None

    stats = record(results.get("sync")) or record(results) or {}
    sent = stats.get("bytes_sent")
    if sent is None:
        columns = [c for c in (rows[0] if rows else ()) if "sync" in c and c.endswith("bytes_total")]
        values = _floats(rows, columns[0]) if columns else []
        sent = values[-1][1] if values else None
    return {
        "bytes_per_step": sent / steps if sent is not None and steps else None,
        "exchanges": stats.get("exchanges"),
        "blocked_s": stats.get("blocked_s"),
    }


def run_job(name: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    start = time.monotonic()
    proc = subprocess.run(
        [*TRAIN, *overrides(name, args, run_dir)], env=env, capture_output=True, text=True, check=False
    )
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    with (run_dir / "csv" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    results = json.loads((run_dir / "results.json").read_text())
    windows = _floats(rows, "train/step_time/total")
    if not windows:
        raise RuntimeError(f"{name}: no train/step_time/total in {run_dir / 'csv' / 'metrics.csv'}")
    val = [(int(s), float(v)) for s, v in (results.get("curves") or {}).get("val/loss") or []] or _floats(
        rows, "val/loss"
    )
    # Training time at each logging step: each logged value is the mean step since the previous logging step.
    mode, every, link = RUNS[name]
    start = args.warm_start if mode != "every_step" else 0
    cum, last, total = [(start, 0.0)], start, 0.0
    for step, mean in windows:
        total += mean * (step - last)
        cum.append((step, total))
        last = step
    steps = results.get("global_step") or args.max_steps
    stats = _sync_stats(results, rows, steps)
    return {
        "mode": mode,
        "every": None if mode == "every_step" else every or args.every,
        "link": link,
        "wall_s": wall,
        "train_s": total + windows[-1][1] * max(0, steps - last),
        "step_s_median": statistics.median(mean for _, mean in windows[1:] or windows),
        "final_val_loss": val[-1][1] if val else None,
        "val_curve": val,
        "cumulative_train_s": cum,
        "bytes_per_step": stats.get("bytes_per_step"),
        "exchanges": stats.get("exchanges"),
        "blocked_s": stats.get("blocked_s"),
    }


def warm_started(run: dict[str, Any], peer: dict[str, Any], warm: int, steps: int) -> None:
    """A run resumed from the peer's step-``warm`` checkpoint: the peer's curve, time and bytes up to it first."""
    offset = time_at(peer["cumulative_train_s"], warm)
    prefix = [(s, t) for s, t in peer["cumulative_train_s"] if s < warm] + [(warm, offset)]
    run["cumulative_train_s"] = prefix + [(s, t + offset) for s, t in run["cumulative_train_s"] if s > warm]
    run["val_curve"] = [p for p in peer["val_curve"] if p[0] <= warm] + [p for p in run["val_curve"] if p[0] > warm]
    run["train_s"] += offset
    if run["bytes_per_step"] is not None and peer["bytes_per_step"] is not None:
        # The run's record counts from the start (the checkpoint carried the peer's first ``warm`` steps'
        # bytes): per step of its own phase, what the mode sends (the figure against every step's).
        run["bytes_per_step_whole_run"] = run["bytes_per_step"]
        own = run["bytes_per_step"] * steps - peer["bytes_per_step"] * warm
        run["bytes_per_step"] = own / (steps - warm)
    run["warm_start"] = warm


def time_at(cum: list[tuple[int, float]], step: float) -> float:
    """Training seconds up to ``step``, interpolated between logging steps (past the last: its mean step)."""
    for (s0, t0), (s1, t1) in zip(cum, cum[1:]):
        if step <= s1:
            return t0 + (t1 - t0) * (step - s0) / max(s1 - s0, 1)
    (s0, t0), (s1, t1) = cum[-2], cum[-1]
    return t1 + (t1 - t0) / max(s1 - s0, 1) * (step - s1)


def time_to(run: dict[str, Any], target: float) -> tuple[float, float] | None:
    """(training seconds, step) at which the validation loss first reaches ``target``, interpolated linearly."""
    curve = run["val_curve"]
    for i, (step, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return 0.0, float(step)
            (s0, l0) = curve[i - 1]
            crossing = s0 + (l0 - target) / (l0 - loss) * (step - s0)
            return time_at(run["cumulative_train_s"], crossing), crossing
    return None


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _targets(peer: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, float | None]:
    """The validation losses the runs race to: every_step's final x ``--target-factor`` (the headline), and
    its loss at half the steps (reached by most runs even when the first is not)."""
    if peer is None or peer["final_val_loss"] is None:
        return {"final": None, "half": None}
    half = [loss for step, loss in peer["val_curve"] if step == args.max_steps // 2]
    return {"final": peer["final_val_loss"] * args.target_factor, "half": half[-1] if half else None}


def report(runs: dict[str, dict[str, Any]], args: argparse.Namespace, load: tuple[float, float]) -> dict[str, Any]:
    import torch

    from lightning_scale.models import GPT

    with torch.device("meta"):
        params = GPT("tiny").num_parameters()
    peer = runs.get("every_step")
    if args.warm_start and peer is not None:
        for run in runs.values():
            if run["mode"] != "every_step":
                warm_started(run, peer, args.warm_start, args.max_steps)
    targets = _targets(peer, args)
    peer_times = {k: time_to(peer, v) if peer and v is not None else None for k, v in targets.items()}
    for run in runs.values():
        for key, suffix in (("final", ""), ("half", "_half")):
            reached = time_to(run, targets[key]) if targets[key] is not None else None
            run[f"time_to_target{suffix}_s"], run[f"step_at_target{suffix}"] = reached or (None, None)
            peer_time = peer_times[key][0] if peer_times[key] else None
            run[f"time_to{suffix}_loss_vs_ddp"] = _ratio(run[f"time_to_target{suffix}_s"], peer_time)
        run["bytes_vs_ddp"] = _ratio(run["bytes_per_step"], peer["bytes_per_step"] if peer else None)
        ratio = _ratio(run["final_val_loss"], peer["final_val_loss"] if peer else None)
        run["val_loss_gap"] = ratio - 1 if ratio is not None else None
    for run in runs.values():
        del run["cumulative_train_s"]
    diloco, bound = runs.get("diloco", {}), runs.get("every_step_no_link", {})
    fields = {
        "bytes_vs_ddp": diloco.get("bytes_vs_ddp"),
        "bytes_bound_vs_ddp": 1 / args.every,
        "time_to_loss_vs_ddp": diloco.get("time_to_loss_vs_ddp"),
        "time_to_loss_bound_vs_ddp": bound.get("time_to_loss_vs_ddp"),
        "time_to_half_loss_vs_ddp": diloco.get("time_to_half_loss_vs_ddp"),
        "time_to_half_loss_bound_vs_ddp": bound.get("time_to_half_loss_vs_ddp"),
        "val_loss_gap": diloco.get("val_loss_gap"),
    }
    goals = {"bytes_vs_ddp": 1 / args.every, "time_to_loss_vs_ddp": 0.6, "val_loss_gap": 0.02}
    return {
        "model": f"tiny GPT ({params:,} parameters)",
        "processes": 2,
        "data": "bundled Shakespeare (bytes), global batch 16 x 128",
        "steps": args.max_steps,
        "every": args.every,
        "val_every": args.val_every,
        "val_batches": args.val_batches,
        "link": {"bandwidth_mbps": args.bandwidth_mbps, "latency_ms": args.latency_ms},
        "warm_start": args.warm_start,
        "overrides": args.overrides,
        "target": {
            "rule": f"every_step's final val loss x {args.target_factor}",
            "val_loss": targets["final"],
            "half_rule": f"every_step's val loss at step {args.max_steps // 2}",
            "half_val_loss": targets["half"],
        },
        **fields,
        "targets": goals,
        "met": {k: fields[k] is not None and fields[k] <= v for k, v in goals.items()},
        "paper": PAPER,
        # How communication-bound the peer is: its step over the same step with no link (meant to be >= 2).
        "ddp_step_vs_compute": _ratio(peer["step_s_median"], bound["step_s_median"]) if peer and bound else None,
        "runs": runs,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": load[0],
        "load_average_at_end": load[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="40 steps, H=10, validation every 20 steps on 2 batches")
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps per run (default 600)")
    parser.add_argument("--every", type=int, default=None, help="H of diloco and local_sgd (default 50)")
    parser.add_argument("--val-every", type=int, default=None, help="steps between validations (default 50)")
    parser.add_argument("--val-batches", type=int, default=None, help="held-out batches per rank (default 20)")
    parser.add_argument("--bandwidth-mbps", type=float, default=50.0)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--target-factor", type=float, default=1.02)
    parser.add_argument(
        "--warm-start",
        type=int,
        default=0,
        help="local runs resume from every_step's checkpoint at this step (0: none)",
    )
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--out", type=Path, default=RESULTS / "sync.json")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (e.g. trainer.limit_val_batches=5)")
    args = parser.parse_args()
    quick = {"max_steps": 40, "every": 10, "val_every": 20, "val_batches": 2}
    full = {"max_steps": 600, "every": 50, "val_every": 50, "val_batches": 20}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown {unknown}; choose from {', '.join(RUNS)}")
    everys = {RUNS[n][1] or args.every for n in names if RUNS[n][0] != "every_step"}
    if any(args.val_every % h for h in everys):
        parser.error(
            f"--val-every {args.val_every} must be a multiple of every H ({sorted(everys)}): a validation "
            "between synchronisations would see one replica's parameters"
        )
    if args.warm_start and (names[0] != "every_step" or args.warm_start % args.val_every):
        parser.error("--warm-start needs every_step first in --runs and a multiple of --val-every")
    if args.max_steps % args.val_every:
        parser.error(f"--max-steps {args.max_steps} must be a multiple of --val-every {args.val_every}")
    print(
        f"link: {args.bandwidth_mbps:g} Mbit/s, {args.latency_ms:g} ms latency per exchange; {args.max_steps} steps, "
        f"H={args.every}, validation every {args.val_every} steps on {args.val_batches} batches per rank",
        flush=True,
    )
    scratch = Path(tempfile.mkdtemp(prefix="sync-bench-"))
    load_start = os.getloadavg()[0]
    runs: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            runs[name] = run = run_job(name, args, scratch / name)
            print(
                f"{name:20s} {run['wall_s']:6.0f} s wall, {run['train_s']:6.1f} s training, "
                f"{run['step_s_median']:.3f} s/step, final val loss {run['final_val_loss']:.4f}, "
                f"bytes/step {run['bytes_per_step']}",
                flush=True,
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = report(runs, args, (load_start, os.getloadavg()[0]))
    target = result["target"]
    print(
        f"target val loss {_fmt(target['val_loss'])} ({target['rule']}); half: {_fmt(target['half_val_loss'])} "
        f"({target['half_rule']})"
    )
    print(f"every_step step / no-link step: {_fmt(result['ddp_step_vs_compute'])} (communication-bound when >= 2)")
    for name, run in runs.items():
        print(
            f"{name:20s} bytes_vs_ddp {_fmt(run['bytes_vs_ddp'])}, time_to_loss_vs_ddp "
            f"{_fmt(run['time_to_loss_vs_ddp'])}, time_to_half_loss_vs_ddp {_fmt(run['time_to_half_loss_vs_ddp'])}, "
            f"val_loss_gap {_fmt(run['val_loss_gap'])}"
        )
    print(f"paper (DiLoCo, {PAPER['source']}): val_loss_gap {PAPER['val_loss_gap']:.4f}", flush=True)
    emit("sync", result, args.out)


if __name__ == "__main__":
    main()
