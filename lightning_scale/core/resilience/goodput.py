"""Goodput: where a run's wall time went, across every attempt (process launch) of it.

The ledger (:mod:`.goodput_ledger` writes it, global rank 0 only) is ``<run_dir>/goodput/events.jsonl``, one
JSON object a line, each with ``event``, ``attempt`` (the attempt's id) and ``time`` (Unix seconds):

- ``start``: the attempt's process start (``time``), the global step training starts at (``step``), the step of
  the checkpoint it resumed (``resumed_step``, null for none) and that checkpoint's commit time (``resumed_commit``),
  ``relaunch`` (torchrun ``--max-restarts`` or a requeued job), ``restart_count``, ``pid``;
- ``first_step``: the first training step's start;
- ``checkpoint``: a save of ``step`` returned to training at ``time``, after blocking it ``blocking_s`` seconds;
- ``end``: training ended, ``status`` ``"completed"`` or ``"interrupted"`` (an exception: preemption, a crash).

Beside it, ``progress-<attempt>.json`` (rewritten every ``progress_s`` by a thread: the last time the attempt was
seen alive, and its step), which is all a SIGKILLed attempt leaves; and ``<run_dir>/hang/events.jsonl``, the hang
watchdog's events. A run is the attempts since the last one that started afresh (no checkpoint resumed, not a
relaunch) or followed a completed one. Its wall time, from the first attempt's process start to the last one's
end, splits exactly into:

- **productive**: training (steps, in-loop validation) whose steps were kept, i.e. not recomputed later;
- **lost**: training after the checkpoint the next attempt resumed from, up to the attempt's last progress;
- **checkpoint**: the time saves blocked training;
- **startup**: the first attempt's, from its process start to its first step;
- **restart**: for each interruption, from the last progress (or the hang's declaration) to the next attempt's
  process start (**rendezvous**: the launcher's detection, the rendezvous, the relaunch) plus that attempt's
  start-up;
- **hang detection**: from a hung step's start to the hang's declaration (the watchdog's limit, and the ranks'
  reports).

``goodput = productive / total``; the mean time to recover is the mean over interruptions of (the first step of
the next attempt that trained - the last progress). Pure functions on the parsed ledger; nothing read back is
trusted: every field is type-checked, a line that is not an event is skipped and named in ``problems``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "EVENTS_FILE",
    "GOODPUT_DIR",
    "Attempt",
    "GoodputSummary",
    "Ledger",
    "parse_event",
    "read_ledger",
    "summarize",
]

GOODPUT_DIR = "goodput"
EVENTS_FILE = "events.jsonl"
PROGRESS_PREFIX = "progress-"
HANG_EVENTS = ("hang", "events.jsonl")  # the watchdog's, under the run directory

_NUMBER, _INT, _STR, _BOOL = "number", "int", "str", "bool"
_FIELDS: dict[str, dict[str, tuple[str, bool]]] = {  # event -> field -> (kind, may be null)
    "start": {
        "attempt": (_STR, False),
        "time": (_NUMBER, False),
        "step": (_INT, False),
        "relaunch": (_BOOL, False),
        "resumed_step": (_INT, True),
        "resumed_commit": (_NUMBER, True),
        "restart_count": (_INT, False),
        "pid": (_INT, False),
    },
    "first_step": {"attempt": (_STR, False), "time": (_NUMBER, False), "step": (_INT, False)},
    "checkpoint": {
        "attempt": (_STR, False),
        "time": (_NUMBER, False),
        "step": (_INT, False),
        "blocking_s": (_NUMBER, False),
    },
    "end": {"attempt": (_STR, False), "time": (_NUMBER, False), "step": (_INT, False), "status": (_STR, False)},
    "progress": {"attempt": (_STR, False), "time": (_NUMBER, False), "step": (_INT, False)},
}
END_STATUSES = ("completed", "interrupted")


def _is(kind: str, value: Any) -> bool:
    if kind == _BOOL:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == _INT:
        return isinstance(value, int) and value >= 0
    if kind == _NUMBER:
        return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
    return isinstance(value, str) and bool(value)


def parse_event(obj: Any) -> dict[str, Any]:
    """``obj`` (a decoded JSON line) as an event with exactly its kind's fields, each of its type; a ``ValueError``
    naming the field otherwise. Numbers come back as ``float``."""
    if not isinstance(obj, dict) or obj.get("event") not in _FIELDS:
        raise ValueError(f"not an event (the 'event' field must be one of {sorted(_FIELDS)})")
    kind = obj["event"]
    out: dict[str, Any] = {"event": kind}
    for name, (type_, nullable) in _FIELDS[kind].items():
        value = obj.get(name)
        if value is None and nullable:
            out[name] = None
        elif not _is(type_, value):
            raise ValueError(f"{kind} event: {name}={value!r} is not a non-negative {type_}")
        else:
            out[name] = float(value) if type_ == _NUMBER else value
    if kind == "end" and out["status"] not in END_STATUSES:
        raise ValueError(f"end event: status={out['status']!r} is not one of {END_STATUSES}")
    return out


@dataclass
class Attempt:
    """One process launch of a run, as its events tell it (times in Unix seconds)."""

    id: str
    start: float
    step: int = 0  # the global step training started at
    relaunch: bool = False
    resumed_step: int | None = None
    resumed_commit: float | None = None
    first_step: float | None = None
    checkpoints: list[tuple[int, float, float]] = field(default_factory=list)  # (step, back to training at, blocking s)
    progress: tuple[int, float] | None = None  # (step, last seen alive at)
    end: tuple[str, float, int] | None = None  # (status, time, step)
    hang: tuple[float, float] | None = None  # (declared at, seconds from the hung step's start)


@dataclass
class Ledger:
    """A run directory's attempts, oldest first, and the lines that could not be read (``problems``)."""

    attempts: list[Attempt] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def add(self, event: Mapping[str, Any]) -> None:
        """One parsed event (:func:`parse_event`) into its attempt; ``ValueError`` for an attempt never started."""
        kind, time = event["event"], event["time"]
        if kind == "start":
            self.attempts.append(
                Attempt(
                    event["attempt"],
                    time,
                    event["step"],
                    event["relaunch"],
                    event["resumed_step"],
                    event["resumed_commit"],
                )
            )
            return
        attempt = next((a for a in reversed(self.attempts) if a.id == event["attempt"]), None)
        if attempt is None:
            raise ValueError(f"{kind} event of attempt {event['attempt']!r}, which has no start event")
        if kind == "first_step" and attempt.first_step is None:
            attempt.first_step = time
        elif kind == "checkpoint":
            attempt.checkpoints.append((event["step"], time, event["blocking_s"]))
        elif kind == "end":
            attempt.end = (event["status"], time, event["step"])
        elif kind == "progress" and (attempt.progress is None or time >= attempt.progress[1]):
            attempt.progress = (event["step"], time)

    def add_hang(self, time: float, detection_s: float) -> None:
        """A hang declared at ``time``, ``detection_s`` after the hung step started: the attempt running then."""
        running = [a for a in self.attempts if a.start <= time]
        if running and (running[-1].end is None or running[-1].end[1] >= time):
            running[-1].hang = (time, detection_s)


def _json_lines(path: Path, ledger: Ledger) -> Iterable[Any]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        ledger.problems.append(f"{path}: cannot read ({err})")
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except ValueError:  # e.g. a line cut short by a kill
            ledger.problems.append(f"{path}:{number}: not JSON")


def read_ledger(run_dir: str | Path) -> Ledger:
    """The goodput ledger of ``run_dir`` (its ``goodput/`` events and progress files, its ``hang/events.jsonl``);
    an empty one when there is none."""
    root = Path(run_dir)
    ledger = Ledger()
    events = root / GOODPUT_DIR / EVENTS_FILE
    found = list(_json_lines(events, ledger)) if events.is_file() else []
    progress = sorted((root / GOODPUT_DIR).glob(f"{PROGRESS_PREFIX}*.json")) if (root / GOODPUT_DIR).is_dir() else []
    for path in progress:
        found += [{**doc, "event": "progress"} if isinstance(doc, dict) else doc for doc in _json_lines(path, ledger)]
    for number, obj in enumerate(found, 1):
        try:
            ledger.add(parse_event(obj))
        except ValueError as err:
            ledger.problems.append(f"{events} (event {number}): {err}")
    ledger.attempts.sort(key=lambda a: a.start)
    hangs = root.joinpath(*HANG_EVENTS)
    for obj in _json_lines(hangs, ledger) if hangs.is_file() else ():
        time, detection = _hang(obj)
        if time is None:
            ledger.problems.append(f"{hangs}: a line without a hang's time")
            continue
        ledger.add_hang(time, detection)
    return ledger


def _hang(obj: Any) -> tuple[float | None, float]:
    """(declared at, seconds since the hung step started) of a hang event of the watchdog: the step's earliest
    start over the ranks' records (each record's ``unix_s`` less its ``step_s``), else the longest ``step_s``."""
    if not isinstance(obj, dict) or obj.get("event") != "hang" or not _is(_NUMBER, obj.get("time")):
        return None, 0.0
    declared = float(obj["time"])
    records = (
        [r for r in obj["records"].values() if isinstance(r, dict)] if isinstance(obj.get("records"), dict) else []
    )
    timed = [r for r in records if _is(_NUMBER, r.get("step_s"))]
    starts = [float(r["unix_s"]) - float(r["step_s"]) for r in timed if _is(_NUMBER, r.get("unix_s"))]
    if starts:
        return declared, max(0.0, declared - min(starts))
    return declared, max((float(r["step_s"]) for r in timed), default=0.0)


PARTS = ("productive_s", "lost_s", "checkpoint_s", "startup_s", "restart_s", "hang_detection_s")
"""The parts a run's wall time splits into (``rendezvous_s`` is part of ``restart_s``)."""


@dataclass(frozen=True)
class GoodputSummary:
    """Where a run's wall time went (seconds; see the module's docstring). ``goodput`` and ``mttr_s`` are None
    when there is nothing to divide by."""

    total_s: float
    productive_s: float
    lost_s: float
    checkpoint_s: float
    startup_s: float
    restart_s: float
    rendezvous_s: float
    hang_detection_s: float
    unaccounted_s: float  # total - the parts: 0 but for a ledger whose times overlap
    goodput: float | None
    mttr_s: float | None
    attempts: int
    interruptions: int
    hangs: int
    per_attempt: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _run(attempts: list[Attempt]) -> list[Attempt]:
    """The attempts of the newest run: since the last fresh start or the last attempt after a completed one."""
    first = 0
    for i, a in enumerate(attempts):
        fresh = a.resumed_step is None and not a.relaunch
        if fresh or (i > 0 and attempts[i - 1].end is not None and attempts[i - 1].end[0] == "completed"):
            first = i
    return attempts[first:]


def _stop(a: Attempt, now: float | None) -> float:
    """When the attempt's training stopped: its end, its hung step's start, else the last sign of life."""
    if a.end is not None:
        return a.end[1]
    if a.hang is not None:
        return a.hang[0] - a.hang[1]
    seen = [a.start, a.first_step or 0.0, *(t for _, t, _ in a.checkpoints), a.progress[1] if a.progress else 0.0]
    return max(*seen, now if now is not None else 0.0)


def _kept_until(a: Attempt, later: list[Attempt]) -> float | None:
    """When ``a``'s kept training ended (None: all of it was kept; -inf: none of it): where it saved the earliest
    checkpoint a later attempt resumed from."""
    if not later:
        return None
    resumed = min(later, key=lambda b: b.resumed_step or 0)
    step = resumed.resumed_step or 0
    if step <= a.step:
        return float("-inf")  # a later attempt went back to where this one started, or further
    saves = [t for s, t, _ in a.checkpoints if s == step]
    if saves:
        return max(saves)
    if resumed.resumed_commit is not None:  # the save's record was lost (e.g. a kill right after it)
        return resumed.resumed_commit
    return float("-inf")


def summarize(attempts: list[Attempt], *, now: float | None = None) -> GoodputSummary | None:
    """Where the newest run's wall time went (None: no attempt). ``now``: the newest attempt is still running,
    its training counted up to ``now``."""
    run = _run(sorted(attempts, key=lambda a: a.start))
    if not run:
        return None
    parts = dict.fromkeys(PARTS, 0.0)
    rendezvous, recoveries, rows = 0.0, [], []
    end = run[0].start
    for i, a in enumerate(run):
        later, last = run[i + 1 :], i == len(run) - 1
        stop = max(_stop(a, now if last else None), a.start)
        finished = a.hang[0] if a.hang is not None and a.end is None else stop  # the hang's declaration ends it
        row = {
            "attempt": a.id,
            "start": a.start,
            "resumed_step": a.resumed_step,
            "first_step": a.first_step,
            "stopped": stop,
            "status": a.end[0] if a.end else ("hang" if a.hang else ("running" if now and last else "killed")),
        }
        startup = (min(a.first_step, stop) if a.first_step is not None else stop) - a.start
        kept_s = lost_s = blocked = 0.0
        if a.first_step is not None:
            first = min(a.first_step, stop)
            kept = _kept_until(a, later)
            cut = stop if kept is None else min(max(kept, first), stop)
            saves = [(t, b) for _, t, b in a.checkpoints if first <= t <= stop]
            blocked_kept = sum((min(b, t - first) for t, b in saves if t <= cut), 0.0)
            blocked_lost = sum((min(b, t - cut) for t, b in saves if t > cut), 0.0)
            kept_s, lost_s, blocked = cut - first - blocked_kept, stop - cut - blocked_lost, blocked_kept + blocked_lost
        hang = finished - stop
        parts["productive_s"] += kept_s
        parts["lost_s"] += lost_s
        parts["checkpoint_s"] += blocked
        parts["hang_detection_s"] += hang
        parts["startup_s" if i == 0 else "restart_s"] += startup
        if i > 0:
            gap = max(0.0, a.start - end)
            rendezvous += gap
            parts["restart_s"] += gap
        end = max(end, finished)
        if not last:
            trained = next((b.first_step for b in later if b.first_step is not None), None)
            if trained is not None:
                recoveries.append(trained - stop)
        rows.append(
            {
                **row,
                "startup_s": startup,
                "productive_s": kept_s,
                "lost_s": lost_s,
                "checkpoint_s": blocked,
                "hang_detection_s": hang,
            }
        )
    total = end - run[0].start
    return GoodputSummary(
        total_s=total,
        **parts,
        rendezvous_s=rendezvous,
        unaccounted_s=total - sum(parts.values()),
        goodput=parts["productive_s"] / total if total > 0 else None,
        mttr_s=sum(recoveries) / len(recoveries) if recoveries else None,
        attempts=len(run),
        interruptions=len(run) - 1,
        hangs=sum(a.hang is not None for a in run),
        per_attempt=rows,
    )
