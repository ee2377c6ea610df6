"""``lightning-scale-study``: a study that steers itself, ending with the answer and its price.

    lightning-scale-study trainer.devices=4 trainer.max_steps=40              # which layout is fastest
    lightning-scale-study study.kind=hparams module.learning_rate=1e-3,3e-3,1e-2 data.global_batch_size=16,32

``study.kind=layouts``: the planner ranks every layout of the training config's processes that fits (and
that ``study.space`` allows), the top ``study.k`` run for ``trainer.max_steps`` steps, the planner is
calibrated on what they measured and re-ranks every layout; layouts it now predicts faster than the best
measured by more than ``study.tolerance`` run next, and so on (``study.max_rounds``) until the predicted and
the measured best agree. ``study.kind=hparams``: every combination of the command line's comma lists is
a trial (``study.equal_tokens``: each on the tokens of ``trainer.max_steps`` at the config's own batch). In
both, a running trial's metric is read off its log at each rung (``study.rungs``), and the
pruner (``study.pruner``) stops a weak one there: SIGTERM, so it commits its checkpoint at the step it
stops at, and its record says "pruned at step N" with the metric.

Each trial is its own set of processes (``torchrun``, as a sweep's job: ``sweep_launch``) in
``<study>/trials/<name>``, with its own ``results.json`` and wandb run. ``<study>/study.json`` is rewritten
after every decision: a rerun of the same command after the driver was killed (SIGKILL included: a trial's
processes die with it) runs no finished or pruned trial again and resumes the one that was running from
its newest checkpoint. ``study.budget_usd``/``study.budget_gpu_hours`` refuse a study whose planned cost
exceeds them and stop one that has spent them. At the end: ``study_report.json``, ``study.png`` and
``winner.yaml`` (:mod:`~lightning_scale.cli.study_report`).

Imports from ``cli``: ``environment``, ``job_config``, ``plan_calibrate``, ``resolvers``, ``results``,
``resume``, ``run``, ``study_report``, ``study_state`` and ``sweep_launch`` (see ``cli/__init__.py``).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from fractions import Fraction
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_scale.cli.job_config import LayoutNotAdmitted, check_fits, layout_of, preflight, world_size
from lightning_scale.cli.resolvers import register_resolvers
from lightning_scale.cli.results import RESULTS_FILE, read_json
from lightning_scale.cli.resume import resumable_checkpoint
from lightning_scale.cli.run import checkpoint_step, prepare_job
from lightning_scale.cli.study_report import write_report
from lightning_scale.cli.study_state import (
    METRICS,
    StudyOptions,
    StudyState,
    halving_survivors,
    log_points,
    rung_metric,
    should_prune,
)
from lightning_scale.cli.sweep_launch import LOG_FILE, torchrun

__all__ = ["Study", "compose_job", "main", "parse_options"]


def parse_options(args: Sequence[str]) -> StudyOptions:
    """``study.*=value`` arguments as :class:`StudyOptions` (values read as YAML, as Hydra reads them)."""
    doc = OmegaConf.to_container(OmegaConf.from_dotlist(list(args)), resolve=True) if args else {}
    given = dict((doc or {}).get("study") or {})  # type: ignore[union-attr]
    known = {f.name for f in fields(StudyOptions)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"study.{unknown[0]} is not a study option; the options are {sorted(known)}.")
    return StudyOptions(**given)


def compose_job(overrides: Sequence[str], run_dir: Path, study: str) -> DictConfig:
    """The training config of one trial, resolved (``run_dir`` and ``study`` set)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module("lightning_scale.conf", version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"run_dir={run_dir}", f"study={study}"])
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cfg.pop("hydra", None)
    return cfg


def _grid(overrides: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """(fixed overrides, the grid: one list of overrides per trial) from Hydra's sweep syntax."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    fixed, axes = [], []
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if override.is_sweep_override():
            key = override.get_key_element()
            axes.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            fixed.append(override.input_line)
    return fixed, [list(combo) for combo in itertools.product(*axes)] if axes else []


def halving_rungs(steps: int, every: int, trials: int, eta: int) -> list[int]:
    """Successive halving's geometric schedule (Jamieson and Talwalkar 2016), its last rung moved to mid-run:
    ``n`` trials fall to one in ``K`` rounds of keeping ``ceil(n / eta)``, at ``steps / eta^K, ...,
    steps / eta^2`` (each at the validation at or before it, the first validation at least) and, last, at the
    first validation at or past ``steps / 2`` instead of ``steps / eta``. Under a decaying learning rate a
    higher rate's loss lags until the decay (short-horizon bias): on the bundled corpus the best trial was
    1.4% behind at a third of the run and ahead from half of it (docs/studies.md)."""
    rounds, left = 0, trials
    while left > 1:
        left, rounds = -(-left // eta), rounds + 1
    if rounds == 0:
        return []
    rungs = {max(every, int(steps / eta**k) // every * every) for k in range(rounds, 1, -1)}
    rungs.add(-(-steps // (2 * every)) * every)
    return sorted(r for r in rungs if r < steps)


def _slug(overrides: Sequence[str]) -> str:
    text = "_".join(o.split("=", 1)[0].split(".")[-1] + "-" + o.split("=", 1)[-1] for o in overrides) or "base"
    safe = "".join(c if c.isalnum() or c in ".-_" else "-" for c in text)[:60]  # no "=": it names a directory
    return f"{safe}-{hashlib.sha256(' '.join(overrides).encode()).hexdigest()[:6]}"


class Study:
    """One study: its options, the training overrides every trial shares, its directory and state."""

    def __init__(self, options: StudyOptions, overrides: Sequence[str]) -> None:
        self.options = options
        self.base, grid = _grid(overrides)
        if options.kind == "layouts" and grid:
            raise ValueError(
                f"study.kind=layouts takes its layouts from the planner, but the command line sweeps "
                f"{[g.split('=')[0] for g in grid[0]]}: give one value each, or use study.kind=hparams for a grid."
            )
        if options.kind == "hparams" and len(grid) < 2:
            raise ValueError(
                "study.kind=hparams needs at least two trials: give comma-separated values on the command line "
                "(e.g. module.learning_rate=1e-3,3e-3,1e-2)."
            )
        asked = json.dumps([sorted(asdict(options).items()), list(overrides)], default=str)
        name = options.name or "study-" + hashlib.sha256(asked.encode()).hexdigest()[:8]
        self.name = name
        self.dir = Path(options.dir).resolve() / name
        self.template = compose_job(self.base, self.dir / "trials" / "template", name)
        preflight(self.template)  # bad training input fails before any job starts
        self.world = world_size(self.template)
        target = str((self.template.get("strategy") or {}).get("_target_", ""))
        if options.kind == "layouts" and not target.endswith("HybridParallelStrategy"):
            raise ValueError(
                f"study.kind=layouts sets the layout of HybridParallelStrategy, but the config's strategy is "
                f"{target or 'none'}: use strategy=hybrid (the default), or study.kind=hparams to compare settings."
            )
        self.grid = grid
        self.trials: dict[str, list[str]] = {}  # name -> its own overrides
        self.predicted: dict[str, dict[str, Any]] = {}  # layouts: name -> candidate and predictions
        self.rungs = self._rungs()
        # equal_tokens: a trial's steps per step of the config's own batch (its rungs and validations scaled too)
        self.scale: dict[str, Fraction] = self._equal_token_scales() if options.equal_tokens else {}
        self.price = self._price()  # $ per device-hour (None: unknown), read once: spent() runs at every poll
        self.state = StudyState(self.dir / "study.json", options, [*self.base, *(" ".join(g) for g in grid)])
        self.state.doc["fixed_overrides"] = list(self.base)

    # ------------------------------------------------------------------ set-up checks

    def _rungs(self) -> list[int]:
        steps = int(self.template.trainer.max_steps)
        if steps <= 0:
            raise ValueError(f"trainer.max_steps={steps}: a study's trials need a fixed length (e.g. 40).")
        if self.options.rungs is not None:
            bad = [r for r in self.options.rungs if r >= steps]
            if bad:
                raise ValueError(
                    f"study.rungs={self.options.rungs} has steps >= trainer.max_steps={steps}; rungs lie inside a trial."
                )
            rungs = sorted(self.options.rungs)
        elif self.options.kind == "layouts":
            rungs = [max(1, steps // 2)]
        else:
            every = self.template.trainer.get("val_check_interval")
            if not isinstance(every, int):
                rungs = []
            elif self.options.pruner == "successive_halving":
                rungs = halving_rungs(steps, every, len(self.grid), self.options.eta)
            else:
                rungs = list(range(every, steps, every))
        key = METRICS[str(self.options.metric)][1]
        if key.startswith("val/"):
            every = self.template.trainer.get("val_check_interval")
            if not isinstance(every, int) or any(r % every for r in rungs):
                raise ValueError(
                    f"study.metric={self.options.metric} is read at each validation, but the rungs {rungs} are not "
                    f"multiples of trainer.val_check_interval={every!r}: set it to an integer dividing every rung."
                )
        return rungs

    def _equal_token_scales(self) -> dict[str, Fraction]:
        """Per trial, how many of its steps take the tokens one step takes at the config's own batch and sequence
        (``data.global_batch_size`` x ``data.seq_len``); refused before any job where a trial's steps, validation
        interval or rungs would not be whole steps."""

        def tokens(cfg: DictConfig, where: str) -> int:
            data = cfg.get("data") or {}
            batch, seq = data.get("global_batch_size"), data.get("seq_len")
            if not isinstance(batch, int) or not isinstance(seq, int):
                raise ValueError(
                    f"study.equal_tokens=true counts a step's tokens as data.global_batch_size x data.seq_len, but "
                    f"{where} has {batch!r} x {seq!r}: give both as integers, or drop study.equal_tokens."
                )
            return batch * seq

        reference = tokens(self.template, "the config")
        counts = self._whole_step_counts() | {f"rung {r}": r for r in self.rungs}
        scales = {}
        for overrides in self.grid:
            cfg = compose_job([*self.base, *overrides], self.dir / "trials" / "template", self.name)
            own = tokens(cfg, f"the trial {' '.join(overrides)}")
            scale = Fraction(reference, own)
            bad = {k: f"{v * scale}" for k, v in counts.items() if (v * scale).denominator != 1}
            if bad:
                raise ValueError(
                    f"study.equal_tokens=true: the trial {' '.join(overrides)} takes {own} tokens a "
                    f"step against the config's {reference}, so its {', '.join(f'{k} would be {v}' for k, v in bad.items())} "
                    f"steps: choose trainer.max_steps, trainer.val_check_interval and the rungs as multiples of "
                    f"{scale.denominator}."
                )
            scales[_slug(overrides)] = scale
        return scales

    def _whole_step_counts(self) -> dict[str, int]:
        """What equal_tokens scales, as the config gives it: the trial's length, validation interval and (the
        reference GPT's) warm-up; one not given as a number of steps (a fraction of an epoch) is left alone."""
        module = self.template.get("module") or {}
        counts = {
            "trainer.max_steps": self.template.trainer.max_steps,
            "trainer.val_check_interval": self.template.trainer.get("val_check_interval"),
            "module.warmup_steps": module.get("warmup_steps"),
        }
        return {k: v for k, v in counts.items() if isinstance(v, int) and not isinstance(v, bool)}

    def _trial_step(self, name: str, step: int) -> int:
        """A step of the config's own batch as the trial's step (the same under equal_tokens's tokens)."""
        return int(step * self.scale.get(name, 1))

    def _price(self) -> float | None:
        """Dollars per device-hour as the jobs' CostMonitor prices them: ``callbacks.cost.price_per_device_hour``,
        else the price table's default for this machine's GPU times ``callbacks.cost.pricing`` (None on a CPU)."""
        cost = (self.template.get("callbacks") or {}).get("cost") or {}
        price = cost.get("price_per_device_hour")
        if isinstance(price, (int, float)) and not isinstance(price, bool) and price > 0:
            return float(price)
        import torch

        from lightning_scale.core.telemetry.cost import device_price, price_multiplier

        gpu = str(self.template.trainer.get("accelerator", "cpu")) in ("gpu", "cuda") and torch.cuda.is_available()
        offer = device_price(torch.cuda.get_device_name(0)) if gpu else None
        return None if offer is None else offer.usd_per_device_hour * price_multiplier(cost.get("pricing", "on_demand"))

    def check_budget(self, planned_device_s: float) -> None:
        hours = planned_device_s / 3600
        if self.options.budget_gpu_hours is not None and hours > self.options.budget_gpu_hours:
            raise ValueError(
                f"study.budget_gpu_hours={self.options.budget_gpu_hours}: the study's plan needs {hours:.4g} device-hours "
                "(its first round at the planner's step times). Raise the budget, lower study.k or trainer.max_steps."
            )
        price = self.price
        if self.options.budget_usd is not None:
            if price is None:
                raise ValueError(
                    "study.budget_usd is set but no price is: set callbacks.cost.price_per_device_hour (dollars per "
                    "device-hour), or give study.budget_gpu_hours instead."
                )
            if hours * price > self.options.budget_usd:
                raise ValueError(
                    f"study.budget_usd={self.options.budget_usd}: the study's plan costs ${hours * price:.4g} "
                    f"({hours:.4g} device-hours at ${price}/h). Raise the budget, lower study.k or trainer.max_steps."
                )

    def spent(self) -> bool:
        hours = self.state.spent_device_s() / 3600
        price = self.price
        over_hours = self.options.budget_gpu_hours is not None and hours >= self.options.budget_gpu_hours
        over_usd = (
            self.options.budget_usd is not None and price is not None and hours * price >= self.options.budget_usd
        )
        return over_hours or over_usd

    # ------------------------------------------------------------------ trials

    def run_trial(
        self,
        name: str,
        overrides: list[str],
        index: int,
        pause_at: int | None = None,
        goes_on: Callable[[int], bool] | None = None,
    ) -> dict[str, Any]:
        """Run one trial to its end or its pruning (nothing when it finished or was pruned before); with
        ``pause_at``, until its metric at that rung is read, then stop it (a checkpoint committed: status
        ``paused``, resumed by the next call), unless ``goes_on(rung)`` says it is kept there already: then
        it runs on, without a stop and a relaunch, to the next rung (or its end)."""
        record = self.state.trial(name, overrides=overrides, index=index)
        if "order" not in record:  # the pruner compares a trial with those that started before it
            record["order"] = sum("order" in t for t in self.state.trials.values())
        if record["status"] in ("completed", "pruned", "failed", "skipped"):
            say(f"{name}: {record['status']} earlier; not run again")
            return record
        if self.spent():
            record.update(status="skipped", reason="the study's budget was spent before it started")
            self.state.save()
            return record
        run_dir = self.dir / "trials" / name
        cfg = compose_job([*self.base, *overrides], run_dir, self.name)
        try:
            try:
                layout = layout_of(cfg, None)
                check_fits(cfg)
            except ValueError as err:
                raise LayoutNotAdmitted(str(err)) from None
            preflight(cfg)
        except ValueError as err:
            record.update(status="skipped", reason=str(err))
            self.state.save()
            say(f"{name}: skipped: {err}")
            return record
        if record["status"] in ("running", "paused"):  # paused, or the driver died while it ran: its newest checkpoint
            cfg.ckpt_path = resumable_checkpoint(cfg)[0]
            if cfg.ckpt_path is not None:
                record.setdefault("resumed_from", []).append(cfg.ckpt_path)
        cfg.sweep.progress_every_s = self.options.poll_s
        job = {"study": self.name, "num": index, "multirun": False, "overrides": overrides, "layout": layout}
        prepare_job(cfg, job)
        config_file = run_dir / "resolved_config.yaml"
        OmegaConf.save(cfg, config_file)
        record.update(status="running", run_dir=str(run_dir), layout=layout["name"], world_size=world_size(cfg))
        self.state.save()
        log = run_dir / LOG_FILE
        start, before = time.monotonic(), float(record.get("device_s", 0.0))
        decision: dict[str, Any] = {}

        def watch() -> bool:
            record["device_s"] = before + (time.monotonic() - start) * record["world_size"]
            if self.spent():
                decision.update(reason="the study's budget was spent")
                return True
            nonlocal pause_at
            behind = self._behind_the_best(record, log)
            if behind:
                decision.update(behind)
                return True
            if pause_at is None:
                return self._at_rungs(record, log, decision)
            self._at_rungs(record, log, {}, prune=False)
            while pause_at is not None and str(pause_at) in record["rungs"]:
                if goes_on is None or not goes_on(pause_at):
                    decision.update(paused=pause_at)
                    return True
                value = record["rungs"][str(pause_at)]
                say(f"{name}: kept at rung {pause_at} ({self.options.metric} {value}) while running: runs on")
                pause_at = next((r for r in self.rungs if r > pause_at), None)
            return False

        say(f"{name}: started ({layout['name']}, {record['world_size']} process(es)); log: {log}")
        code = torchrun(cfg, config_file, log, name, watch=watch, poll_s=self.options.poll_s)
        record["device_s"] = before + (time.monotonic() - start) * record["world_size"]
        if not decision:
            self._at_rungs(record, log, {})  # rungs passed since the last look
        self._behind_the_best(record, log, judge=False)  # the validations since the last look
        results = read_json(run_dir / RESULTS_FILE) or {}
        if decision and code == 0 and results.get("status") == "completed":
            decision = {}  # it finished before the signal reached it: a completed trial
        if decision.get("paused") is not None:
            step = _checkpoint_step(cfg)
            record.update(status="paused", paused_at=step)
            say(
                f"{name}: paused at step {step} after rung {pause_at} ({self.options.metric} {record['rungs'].get(str(pause_at))})"
            )
        elif decision:  # stopped by SIGTERM (torchrun's agent exits 1 on it; the ranks commit and exit 143)
            step = _checkpoint_step(cfg)
            record.update(status="pruned", pruned_at=step, exit_code=code, **decision)
            committed = f"its checkpoint at step {step}" if step is not None else "no checkpoint was committed"
            say(f"{name}: pruned at step {step} ({committed}): {decision.get('reason')}")
        elif code == 0 and results.get("status") == "completed":
            value = results.get(METRICS[str(self.options.metric)][2])
            record.update(status="completed", value=value, results=str(run_dir / RESULTS_FILE))
            say(f"{name}: completed; {self.options.metric} {value}")
        else:
            record.update(status="failed", reason=f"exit code {code}; log: {log}")
            say(f"{name}: failed (exit code {code}); log: {log}")
        self.state.save()
        return record

    def _behind_the_best(self, record: dict[str, Any], log: Path, *, judge: bool = True) -> dict[str, Any] | None:
        """Successive halving with a ``rung_tolerance``: record the trial's validations (``curve``, by the config's
        steps) and, with ``judge``, the stop of a trial more than ``rung_tolerance`` behind the best value another
        trial had at one of them past the last rung. Trials kept at the last rung as a tie are settled this way
        as they run on; before it, the rungs judge (where the user placed them: a learning rate that lags
        mid-run and wins at the end is not stopped in between)."""
        tolerance = self.options.rung_tolerance
        if self.options.kind != "hparams" or self.options.pruner != "successive_halving" or tolerance <= 0:
            return None  # nothing to settle: no log read at every poll
        curve = record.setdefault("curve", {})
        scale, last = self.scale.get(record["name"], Fraction(1)), max(self.rungs, default=0)
        new = {}
        for step, value in log_points(log, METRICS[str(self.options.metric)][1]):
            at = Fraction(step) / scale
            if at.denominator == 1 and str(at.numerator) not in curve:
                new[at.numerator] = value
        if not new:
            return None
        curve.update({str(at): value for at, value in new.items()})
        self.state.save()
        for at, value in new.items():
            others = [
                t["curve"][str(at)]
                for t in self.state.trials.values()
                if t is not record and str(at) in t.get("curve", {})
            ]
            if not judge or at <= last or not others:
                continue
            best = max(others) if self.options.maximise else min(others)
            if (math.isfinite(value) and abs(value - best) <= tolerance * abs(best)) or self.options.better(
                value, best
            ):
                continue
            return {
                "reason": f"{self.options.metric} {value:.6g} at step {at}: more than rung_tolerance "
                f"{tolerance} behind the best of {len(others)} other trial(s) there ({best:.6g})",
                "value_at_prune": value,
                "rung": at,
            }
        return None

    def _at_rungs(self, record: dict[str, Any], log: Path, decision: dict[str, Any], *, prune: bool = True) -> bool:
        """Record the rungs the trial's log has reached; with ``prune``, True when the pruner stops it at one
        (``decision`` filled); without, True when anything new was recorded."""
        key = METRICS[str(self.options.metric)][1]
        new = False
        for rung in self.rungs:
            if str(rung) in record["rungs"]:
                continue
            value = rung_metric(log, key, self._trial_step(record["name"], rung))
            if value is None:
                return new and not prune
            new = True
            if not prune:
                record["rungs"][str(rung)] = value
                self.state.save()
                continue
            others = [
                t["rungs"][str(rung)]
                for t in self.state.trials.values()
                if t is not record and str(rung) in t["rungs"] and t.get("order", 0) < record["order"]
            ]
            record["rungs"][str(rung)] = value
            self.state.save()
            if not decision and should_prune(self.options, value, others):
                decision.update(
                    reason=f"{self.options.metric} {value:.6g} at step {rung} ({self.options.pruner} of "
                    f"{len(others)} earlier: {[round(o, 6) for o in others]})",
                    value_at_prune=value,
                    rung=rung,
                )
                return True
        return new and not prune

    # ------------------------------------------------------------------ the two kinds

    def run(self) -> int:
        os.environ.setdefault("LIGHTNING_SCALE_PEAK_FILE", str(self.dir / "peaks.json"))
        if self.options.kind == "hparams":
            return self._hparams()
        return self._layouts()

    def _hparams(self) -> int:
        counts = self._whole_step_counts()
        for overrides in self.grid:
            name = _slug(overrides)
            self.trials[name] = list(overrides)
            if name in self.scale:  # equal_tokens: the trial's own steps, after the grid's values
                self.trials[name] += [f"{key}={self._trial_step(name, value)}" for key, value in counts.items()]
        per_step = self._planned_trial_s() / int(self.template.trainer.max_steps)
        self.state.doc["planned_device_s"] = planned = per_step * self._planned_steps()
        self.check_budget(planned)
        self.state.save()
        if self.options.pruner == "successive_halving":
            self._successive_halving()
        else:
            for i, (name, overrides) in enumerate(self.trials.items()):
                self.run_trial(name, overrides, i)
        return self._finish()

    def _successive_halving(self) -> None:
        """Synchronous successive halving (Jamieson and Talwalkar 2016), as a driver that runs one job at a time
        does it: every trial to the first rung (paused there, its checkpoint committed), the best
        ``ceil(n / eta)`` resume to the next, and so on; the others are pruned at that rung. Which trials go on
        does not depend on the order they run in. A round's last trial meets its rung knowing every other value
        there: when it is kept it runs on, sparing a stop, a checkpoint and a relaunch."""
        names = list(self.trials)
        alive = [n for n in names if self.state.trials.get(n, {}).get("status") not in ("pruned", "failed", "skipped")]
        for rung in [*self.rungs, None]:
            for name in alive:
                record = self.state.trials.get(name, {})
                if rung is not None and str(rung) in record.get("rungs", {}):
                    continue  # reached this rung in an earlier run of the driver, or ran on to it
                goes_on = functools.partial(self._kept_by_all, name, alive)
                self.run_trial(name, self.trials[name], names.index(name), pause_at=rung, goes_on=goes_on)
            if rung is None:
                break
            reached = [n for n in alive if str(rung) in self.state.trials[n]["rungs"]]
            ranked = sorted(
                reached, key=lambda n: self.state.trials[n]["rungs"][str(rung)], reverse=self.options.maximise
            )
            keep = len(halving_survivors(self.options, [self.state.trials[n]["rungs"][str(rung)] for n in ranked]))
            for name in ranked[keep:]:
                record = self.state.trials[name]
                if record["status"] in ("paused", "running"):
                    value = record["rungs"][str(rung)]
                    record.update(
                        status="pruned",
                        pruned_at=record.get("paused_at"),
                        rung=rung,
                        value_at_prune=value,
                        reason=f"{self.options.metric} {value:.6g} at step {rung}: not among the best {keep} of "
                        f"{len(reached)} (successive_halving, eta {self.options.eta}, rung_tolerance "
                        f"{self.options.rung_tolerance})",
                    )
                    say(f"{name}: pruned at step {record['pruned_at']}: {record['reason']}")
            self.state.save()
            # The next rung's order: worst first, so the last to run (the one that learns, while it runs, that
            # it is kept: it runs on without a stop and a relaunch) is the likeliest to be kept.
            alive = [n for n in reversed(ranked[:keep]) if self.state.trials[n]["status"] in ("paused", "running")]

    def _kept_by_all(self, name: str, alive: Sequence[str], rung: int) -> bool:
        """Successive halving, asked while ``name`` runs: whether it goes on past ``rung`` whatever is still to
        come; only when every other trial of the round has a value there (it is the round's last)."""
        values = {
            n: r.get("rungs", {}).get(str(rung))
            for n in alive
            if (r := self.state.trials.get(n, {})).get("status") not in ("failed", "skipped", "pruned")
        }
        if any(v is None for v in values.values()):
            return False
        mine = values.pop(name)
        return mine in halving_survivors(self.options, [mine, *values.values()])

    def _planned_steps(self) -> int:
        """Optimizer steps a hyper-parameter study plans: successive halving's whole schedule (every trial to
        the first rung, the best ``1/eta`` of them to the next, ...); otherwise its least, one trial whole and
        every other to the first rung."""
        n, steps = len(self.grid), int(self.template.trainer.max_steps)
        if self.options.pruner != "successive_halving":
            return steps + (n - 1) * (self.rungs[0] if self.rungs else steps)
        total, done = 0, 0
        for rung in [*self.rungs, steps]:
            total += n * (rung - done)
            n, done = max(1, -(-n // self.options.eta)), rung
        return total

    def _planned_trial_s(self) -> float:
        """A trial's device-seconds at the planner's step time for the config's own layout."""
        from lightning_scale.cli.study_layouts import predicted_step_time

        return predicted_step_time(self.template) * int(self.template.trainer.max_steps) * self.world

    def _layouts(self) -> int:
        from lightning_scale.cli.study_layouts import calibrated_predictions, candidates, first_round

        found = candidates(self.template, self.options.space)
        if self.options.k > len(found):
            raise ValueError(
                f"study.k={self.options.k} but only {len(found)} layout(s) of {self.world} process(es) fit and are "
                f"allowed ({', '.join(found)}). Use study.k<={len(found)} or widen study.space."
            )
        self.predicted = found
        for name, c in found.items():
            self.trials[name] = c["overrides"]
        # A rerun ranks as the first run did (the CPU's measured peak, which the planner scales by, varies a little).
        before = self.state.doc.get("predicted_before") or {n: found[n]["tokens_per_sec"] for n in found}
        ranked = sorted(found, key=lambda n: -before.get(n, 0.0))
        steps = int(self.template.trainer.max_steps)
        self.check_budget(sum(found[n]["step_time"] * steps * self.world for n in ranked[: self.options.k]))
        self.state.doc["predicted_before"] = before
        self.state.doc["candidates"] = {n: found[n]["overrides"] for n in found}
        self.state.doc["rounds"] = []  # recomputed from the trials' records (a rerun skips what finished)
        self.state.save()
        # The first round: the planner's fastest and the layouts that pin the fitted factors best per second.
        batch = self.state.doc.get("first_round") or first_round(found, self.options.k)
        self.state.doc["first_round"] = batch
        self.state.save()
        for round_ in range(self.options.max_rounds + 1):
            for name in batch:
                self.run_trial(name, found[name]["overrides"], ranked.index(name))
            partial = {  # what the pruned layouts measured before they stopped: calibration learns from them too
                n: float(next(iter(t["rungs"].values())))
                for n, t in self.state.trials.items()
                if t["status"] == "pruned" and t["rungs"] and self.options.metric == "tokens_per_sec"
            }
            after = calibrated_predictions(self.dir / "trials", found, partial)
            self.state.doc["predicted_after"] = after
            measured = self._measured()
            if not measured or not after:
                break
            best = max(measured, key=measured.__getitem__)
            ahead = sorted(
                (n for n in after if n not in self.state.trials or self.state.trials[n]["status"] == "pending"),
                key=lambda n: -after[n],
            )
            batch = [n for n in ahead if after[n] > measured[best] * (1 + self.options.tolerance)][: self.options.k]
            self.state.doc["rounds"].append({"round": round_, "measured_best": best, "next": batch})
            self.state.save()
            if not batch or self.spent():
                break
        return self._finish()

    def _measured(self) -> dict[str, float]:
        return {
            n: float(t["value"])
            for n, t in self.state.trials.items()
            if t["status"] == "completed" and isinstance(t.get("value"), (int, float))
        }

    def _finish(self) -> int:
        report = write_report(self.dir, self.state.doc, self.options, self.predicted, self.price)
        say(report["summary"])
        return 0 if report.get("winner") else 1


def _checkpoint_step(cfg: DictConfig) -> int | None:
    """The step of the trial's newest checkpoint (None: it has none)."""
    found, _ = resumable_checkpoint(cfg)
    return None if found is None else checkpoint_step(found)


HELP = __doc__.split("Each trial")[0].replace("``", "") + "Every option: docs/studies.md\n"


def say(message: str) -> None:
    print(f"[study] {message}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(HELP)
        return 0
    register_resolvers()
    options = parse_options([a for a in args if a.startswith("study.")])
    study = Study(options, [a for a in args if not a.startswith("study.")])
    return study.run()


if __name__ == "__main__":
    sys.exit(main())
