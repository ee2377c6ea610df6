"""What a self-steering study (``lightning-scale-study``) is asked, what it decides and what it keeps.

- :class:`StudyOptions`: the ``study.*`` options, each checked before any job starts (a ``ValueError``
  naming the value, the rule and the fix);
- the pruners (:func:`should_prune`): ``median`` (a trial stops at a rung when its metric is worse than
  the median of the earlier trials' at that rung, Optuna's ``MedianPruner``) and ``successive_halving``
  (asynchronous successive halving, as ASHA: a trial goes on past a rung only while it is in the best
  ``1/eta`` of the trials that reached it);
- :class:`StudyState`: ``study.json``, rewritten whole (temporary file, rename) after every decision, so a
  driver killed at any moment leaves a state the next run takes up: finished and pruned trials are never
  run again, a trial that was running resumes from its newest checkpoint;
- :func:`rung_metric`: a running trial's metric at a step, read off its log (the ``ConsoleLogger`` lines).

Imports from ``cli`` only ``results`` (see ``cli/__init__.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lightning_scale.cli.results import read_json, write_json

__all__ = ["METRICS", "PRUNERS", "StudyOptions", "StudyState", "rung_metric", "should_prune"]

METRICS: dict[str, tuple[str, str, str]] = {
    # name -> (direction, the log line's key, results.json's key)
    "tokens_per_sec": ("max", "train/tokens_per_sec", "tokens_per_sec"),
    "mfu": ("max", "train/mfu", "mfu"),
    "val_loss": ("min", "val/loss", "final_val_loss"),
    "train_loss": ("min", "train/loss", "final_train_loss"),
}
"""The metrics a study ranks and prunes on."""
PRUNERS = ("none", "median", "successive_halving")
KINDS = ("layouts", "hparams")
LAUNCHERS = ("torchrun",)


def _positive(name: str, value: Any, fix: str, *, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0 or not math.isfinite(value):
        what = "a positive integer" if integer else "a positive number"
        raise ValueError(f"study.{name}={value!r} must be {what}. {fix}")


@dataclass
class StudyOptions:
    """``study.*`` of ``lightning-scale-study`` (docs/studies.md)."""

    kind: str = "layouts"
    """``layouts``: the planner proposes the layouts of the training config's processes; ``hparams``: the
    grid of the command line's comma-separated overrides (``module.learning_rate=1e-3,3e-3``)."""
    name: str | None = None
    """The study's directory name under ``dir`` (default: made from the command line)."""
    dir: str = "studies"
    k: int = 4
    """Layouts run for the first calibration: the planner's top ``k``."""
    metric: str | None = None
    """What ranks the trials and what the pruner reads: tokens_per_sec (layouts' default), val_loss (hparams')."""
    pruner: str = "median"
    eta: int = 3
    """successive_halving: the fraction ``1/eta`` of the trials at a rung that go on."""
    rung_tolerance: float = 0.0
    """successive_halving: a trial whose metric at a rung is within this fraction of the last trial kept there
    goes on too (ties are not cut). Validation losses within 1% at a rung ended in either order about half
    the time in this package's study benchmark (docs/studies.md), so 0.01 avoids most wrong cuts, at the price
    of the extra trials' steps; 0 is classic successive halving."""
    rungs: list[int] | None = None
    """The steps at which the pruner looks (default: layouts, half the steps; hparams, every validation, and
    under successive halving its geometric schedule, the last rung at mid-run: :func:`~lightning_scale.cli.study.halving_rungs`)."""
    equal_tokens: bool = False
    """hparams: every trial trains on the tokens of the config's own batch over ``trainer.max_steps`` (a trial
    of twice the batch, or of twice the sequence, takes half the steps), and validates and meets its rungs at
    the same tokens; ``False``: every trial takes ``trainer.max_steps``. A batch-size study compares sizes at
    equal data this way: at equal steps the larger batch has seen more."""
    min_trials: int = 1
    """Trials that reach a rung before the pruner may stop one there."""
    tolerance: float = 0.05
    """Layouts: the study stops when no layout it has not run is predicted faster than the best measured by more."""
    max_rounds: int = 3
    """Layouts: calibrate-and-rerank rounds after the first."""
    budget_usd: float | None = None
    budget_gpu_hours: float | None = None
    """Device-hours (GPUs, or the processes of a CPU run)."""
    space: dict[str, list[Any]] = field(default_factory=dict)
    """Layouts: allowed values of the strategy's options (``{data_parallel_mode: [ddp, fsdp]}``)."""
    launcher: str = "torchrun"
    poll_s: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"study.kind={self.kind!r} is not a study kind; choose one of {list(KINDS)}.")
        if self.metric is None:
            self.metric = "tokens_per_sec" if self.kind == "layouts" else "val_loss"
        if self.metric not in METRICS:
            raise ValueError(
                f"study.metric={self.metric!r} is not a metric a study can rank on; choose one of {sorted(METRICS)}."
            )
        if not isinstance(self.equal_tokens, bool):
            raise ValueError(f"study.equal_tokens={self.equal_tokens!r} must be true or false.")
        if self.equal_tokens and self.kind != "hparams":
            raise ValueError(
                "study.equal_tokens=true scales each trial's steps to its batch, but a layout study keeps the batch: "
                "use it with study.kind=hparams."
            )
        if self.pruner not in PRUNERS:
            raise ValueError(f"study.pruner={self.pruner!r} is not a pruner; choose one of {list(PRUNERS)}.")
        if self.launcher not in LAUNCHERS:
            raise ValueError(
                f"study.launcher={self.launcher!r}: the study driver starts each job's processes itself with torchrun "
                "on this machine, and the pruner stops them with SIGTERM between two steps; a launcher that hands the "
                f"job to a scheduler (submitit, srun) gives it no process to stop. Use study.launcher=torchrun"
                + (" (or study.pruner=none to sweep on a cluster: lightning-scale-train -m)." if self.pruner else ".")
            )
        _positive("k", self.k, "It is how many of the planner's best layouts run first (e.g. study.k=4).", integer=True)
        _positive("eta", self.eta, "It is the reduction factor of successive halving (e.g. study.eta=3).", integer=True)
        if self.eta < 2:
            raise ValueError(f"study.eta={self.eta} keeps every trial; successive halving needs eta >= 2 (e.g. 3).")
        _positive("min_trials", self.min_trials, "e.g. study.min_trials=1.", integer=True)
        _positive("max_rounds", self.max_rounds, "e.g. study.max_rounds=3.", integer=True)
        _positive("poll_s", self.poll_s, "It is how often a running job's log is read (e.g. study.poll_s=0.5).")
        if (
            isinstance(self.tolerance, bool)
            or not isinstance(self.tolerance, (int, float))
            or not 0 <= self.tolerance < 1
        ):
            raise ValueError(f"study.tolerance={self.tolerance!r} must be a fraction in [0, 1) (e.g. 0.05).")
        if (
            isinstance(self.rung_tolerance, bool)
            or not isinstance(self.rung_tolerance, (int, float))
            or not 0 <= self.rung_tolerance < 1
        ):
            raise ValueError(
                f"study.rung_tolerance={self.rung_tolerance!r} must be a fraction in [0, 1) (e.g. 0.01: trials within "
                "1% of the last one kept at a rung go on too)."
            )
        for name in ("budget_usd", "budget_gpu_hours"):
            value = getattr(self, name)
            if value is not None:
                _positive(
                    name,
                    value,
                    f"Leave it unset for no budget, or give the most the study may spend (e.g. study.{name}=10).",
                )
        if self.rungs is not None:
            if not isinstance(self.rungs, list) or not self.rungs:
                raise ValueError(f"study.rungs={self.rungs!r} must be a non-empty list of steps (e.g. [20, 60]).")
            for r in self.rungs:
                _positive("rungs", r, "Each rung is an optimizer step (e.g. study.rungs=[20,60]).", integer=True)
        if not isinstance(self.space, Mapping) or not all(isinstance(v, list) and v for v in self.space.values()):
            raise ValueError(
                f"study.space={self.space!r} must map strategy options to lists of allowed values "
                "(e.g. study.space={data_parallel_mode:[ddp,fsdp]})."
            )
        if self.name is not None and (not isinstance(self.name, str) or not re.fullmatch(r"[\w.-]+", self.name)):
            raise ValueError(f"study.name={self.name!r} must be a plain name (letters, digits, '.', '-', '_').")

    @property
    def maximise(self) -> bool:
        assert self.metric is not None
        return METRICS[self.metric][0] == "max"

    def better(self, a: float, b: float) -> bool:
        return a > b if self.maximise else a < b


def should_prune(options: StudyOptions, value: float, others: Sequence[float]) -> bool:
    """Whether a trial whose metric at a rung is ``value`` stops there, given the values of the trials that
    reached the rung before it (``others``)."""
    if options.pruner == "none" or len(others) < options.min_trials:
        return False
    if not math.isfinite(value):
        return True
    if options.pruner == "median":
        ordered = sorted(others)
        n = len(ordered)
        median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        return not (value >= median if options.maximise else value <= median)
    return value not in halving_survivors(options, [*others, value])


def halving_survivors(options: StudyOptions, values: Sequence[float]) -> list[float]:
    """The values of a rung that go on under successive halving, best first: the best ``ceil(n / eta)``, and
    any within ``rung_tolerance`` (relative) of the last of them."""
    ranked = sorted(values, reverse=options.maximise)
    if not ranked:
        return []
    keep = max(1, math.ceil(len(ranked) / options.eta))
    cut = ranked[keep - 1]
    margin = options.rung_tolerance * abs(cut)
    return [v for i, v in enumerate(ranked) if i < keep or (math.isfinite(v) and abs(v - cut) <= margin)]


_STEP = re.compile(r"^step (\d+)(?:/\d+)?((?: \| [^|]+)*)$")
_VALIDATION = re.compile(r"^validation at step (\d+)((?: \| [^|]+)*)$")


def _fields(tail: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in tail.split("|"):
        bits = part.strip().split(" ")
        if len(bits) >= 2:
            try:
                out[bits[0]] = float(bits[1].replace(",", ""))
            except ValueError:
                pass
    return out


def log_points(log: Path, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of ``key`` on each of the log's ``ConsoleLogger`` lines that carry it, in order."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    points = []
    pattern = _VALIDATION if key.startswith("val/") else _STEP
    for line in text.splitlines():
        m = pattern.match(line.strip())
        if m:
            values = _fields(m.group(2))
            if key in values:
                points.append((int(m.group(1)), values[key]))
    return points


def rung_metric(log: Path, key: str, rung: int) -> float | None:
    """The metric at ``rung``: its first logged value at a step at or past it (None: not reached yet)."""
    return next((v for step, v in log_points(log, key) if step >= rung), None)


class StudyState:
    """``<study dir>/study.json``: the options, every trial with its status (``pending``, ``running``,
    ``completed``, ``pruned``, ``failed``, ``skipped``), its rung values and the device-seconds spent."""

    def __init__(self, path: Path, options: StudyOptions, base: Sequence[str]) -> None:
        self.path = path
        found = read_json(path)
        if found is not None:
            # An option added since the study was stored is the same one where this run leaves it at its default.
            defaults = {f.name: f.default for f in fields(StudyOptions) if f.default is not MISSING}
            mine = asdict(options)
            stored = found.get("options")
            if isinstance(stored, dict):
                found["options"] = {
                    **{k: v for k, v in mine.items() if k not in stored and k in defaults and v == defaults[k]},
                    **stored,
                }
            if found.get("options") != mine or found.get("base_overrides") != list(base):
                raise ValueError(
                    f"{path.parent} holds a study with other options or overrides ({found.get('options')}, "
                    f"{found.get('base_overrides')}); name this one otherwise (study.name=...) or remove that directory."
                )
            self.doc = found
        else:
            self.doc = {
                "options": asdict(options),
                "base_overrides": list(base),
                "trials": {},
                "rounds": [],
                "events": [],
            }

    @property
    def trials(self) -> dict[str, dict[str, Any]]:
        return self.doc["trials"]

    def trial(self, name: str, **fields: Any) -> dict[str, Any]:
        record = self.trials.setdefault(name, {"name": name, "status": "pending", "rungs": {}, "device_s": 0.0})
        record.update(fields)
        return record

    def event(self, text: str) -> None:
        self.doc["events"].append(text)

    def spent_device_s(self) -> float:
        return sum(float(t.get("device_s", 0.0)) for t in self.trials.values())

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, self.doc)
