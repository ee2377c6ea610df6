"""The hang watchdog: a daemon thread per rank that times each training step against a heartbeat.

The training loop sets the heartbeat (:meth:`StepWatchdog.step_started`, :meth:`~StepWatchdog.entered`,
:meth:`~StepWatchdog.step_finished`: an attribute store each, no collective, no host sync). The thread
looks every ``poll_s`` seconds. When this rank's step has run longer than its limit
(:class:`HangTimeout`), or another rank declared a hang, it cannot rely on a collective (the group is
stuck in one), so the ranks meet in the key-value store the process group was created with:

1. the first rank to see a step over its limit declares the hang (a counter in the store);
2. every rank writes ``<directory>/rank<k>.txt`` (its heartbeat, every thread's Python stack, and with the
   flight recorder on, its trace) and puts its record in the store;
3. the first rank to see every record (or after ``grace_s``) writes ``summary.txt``, naming the ranks that
   are behind (:func:`~lightning_scale.core.resilience.hang_report.laggards`), and appends the event to
   ``events.jsonl`` (one JSON line per hang, for whatever counts a run's lost time);
4. every process exits with :data:`HANG_EXIT_CODE` (``os._exit``: its main thread is stuck), rank 0 last,
   since it may serve the store.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist

from lightning_scale.core.checks import check_positive_int, check_positive_number
from lightning_scale.core.compat_c10d import default_store
from lightning_scale.core.resilience.hang_report import (
    PHASES,
    flight_recorder,
    innermost_frame,
    laggards,
    summary_text,
    thread_stacks,
    waiting_collective,
)

__all__ = ["HANG_EXIT_CODE", "HangTimeout", "StepWatchdog", "hang_timeout_policy"]

HANG_EXIT_CODE = 75
"""The exit status of every process after a hang: ``EX_TEMPFAIL`` of ``sysexits.h`` ("temporary failure,
retry"), distinct from the preemption's 143. Non-zero, so torchrun ``--max-restarts`` relaunches the job
and a SLURM script can requeue on it; the relaunch resumes from ``"latest"``."""

_GENERATIONS = itertools.count()  # one store namespace per watchdog: every rank starts its fits in the same order


@dataclass(frozen=True)
class HangTimeout:
    """How long a training step may run before it is a hang.

    A step's limit is ``max(floor_s, multiple x the median of the last window steps)``; the first
    ``warmup_steps`` steps of a fit (compilation, warm-up, the first collectives' set-up) get at least
    ``warmup_s`` and are not counted in the median. A fixed limit is ``floor_s = warmup_s`` with
    ``multiple = 0``, what ``hang_timeout=<seconds>`` gives.

    The warm-up steps are the *run's* first steps: a fit resumed at global step ``k`` (a restart, an
    auto-resume) counts its ``k`` steps done, so past ``warmup_steps`` a restarted run is timed against
    the floor from its first step, not given the warm-up allowance again (a hang right after a restart is
    found within ``floor_s``). A restart's first step recompiles from torch's on-disk caches; where it may
    still outlast ``floor_s`` (a cold cache on a new host), raise ``floor_s``.
    """

    floor_s: float = 120.0
    multiple: float = 10.0
    warmup_s: float = 600.0
    warmup_steps: int = 3
    window: int = 20

    def __post_init__(self) -> None:
        check_positive_number("floor_s", self.floor_s, unit="seconds")
        check_positive_number("warmup_s", self.warmup_s, unit="seconds")
        multiple = self.multiple
        if isinstance(multiple, bool) or not isinstance(multiple, (int, float)) or not 0 <= multiple < math.inf:
            raise ValueError(f"multiple={multiple!r} must be a finite number of 0 or more (0: the limit is floor_s).")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps!r} must be an integer of 0 or more.")
        check_positive_int("window", self.window)

    def limit(self, completed: int, recent: list[float]) -> float:
        """Seconds the next step may run, after ``completed`` steps of which ``recent`` (past the warm-up)
        were timed."""
        adaptive = max(self.floor_s, self.multiple * statistics.median(recent)) if recent else self.floor_s
        return max(self.warmup_s, adaptive) if completed < self.warmup_steps else adaptive


def hang_timeout_policy(value: Any) -> HangTimeout | None:
    """The :class:`HangTimeout` an option value means, or None (the watchdog is off).

    ``"auto"``, ``None`` or ``True``: the defaults (at least 120 s, 10x the recent median step, 600 s for
    the first 3 steps); a number of seconds: that limit for every step; a mapping of :class:`HangTimeout`'s
    fields (from a YAML config) or a ``HangTimeout``; ``0`` or ``False``: off. Anything else is a
    ``ValueError`` naming the value and what to pass.
    """
    fix = (
        "Pass 'auto' (at least 120 s, 10x the recent median step), a number of seconds, a mapping of "
        f"HangTimeout fields ({', '.join(f.name for f in fields(HangTimeout))}), or 0/False to turn the watchdog off."
    )
    if value is None or value is True or value == "auto":
        return HangTimeout()
    if value is False or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0):
        return None
    if isinstance(value, HangTimeout):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not 0 < value < math.inf:
            raise ValueError(f"hang_timeout={value!r} must be a positive finite number of seconds. {fix}")
        return HangTimeout(floor_s=float(value), multiple=0.0, warmup_s=float(value))
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in {f.name for f in fields(HangTimeout)})
        if unknown:
            raise ValueError(f"hang_timeout={dict(value)!r} has unknown keys {unknown}. {fix}")
        try:
            return HangTimeout(**{str(k): v for k, v in value.items()})
        except ValueError as err:
            raise ValueError(f"hang_timeout={dict(value)!r}: {err} {fix}") from None
    raise ValueError(f"hang_timeout={value!r} is not a timeout. {fix}")


class _Beat(NamedTuple):
    batch: int  # the batch's index in this fit (from 0, across epochs)
    global_step: int | None  # None: read when a hang is reported
    step_started: float


class StepWatchdog:
    """A hang watchdog for one rank (see the module's docstring).

    Args:
        policy: the steps' limits.
        rank, world_size: this process's global rank and the number of processes.
        directory: where the reports go (``<run_dir>/hang``), created when a hang is declared.
        store: the process group's key-value store (``None``: one process, nobody to meet).
        backend: the process group's backend; ``"nccl"`` dumps NCCL's flight recorder, any backend dumps
            the CPU one when ``TORCH_FR_BUFFER_SIZE`` is set.
        poll_s: seconds between two looks (default: ``floor_s / 20``, from 0.05 to 2 s).
        grace_s: how long the ranks wait for each other's records before the summary is written anyway.
        namespace: the prefix of this watchdog's keys in the store, the same on every rank (default: the
            number of watchdogs this process made before, equal on every rank as they start their fits alike).
        exit: what ends the process (``os._exit``; a test passes a recorder).
        global_step: reads the training's global step, for a report of a batch started without it.
        steps_before: the run's steps done before this fit (a resumed fit's global step): they count towards
            the policy's warm-up steps, so a restart is not given the warm-up allowance again.
        untimed: called by the watchdog's thread at each look (never by the training loop): True while the
            process does something that is not a step (the Trainer validating, an epoch ending). Nothing is
            timed then, and the step that goes on afterwards is timed from the last look that saw it.
    """

    def __init__(
        self,
        policy: HangTimeout,
        *,
        rank: int,
        world_size: int,
        directory: str | os.PathLike,
        store: Any | None = None,
        backend: str | None = None,
        poll_s: float | None = None,
        grace_s: float = 20.0,
        namespace: str | None = None,
        exit: Callable[[int], Any] = os._exit,
        global_step: Callable[[], int] | None = None,
        steps_before: int = 0,
        untimed: Callable[[], bool] | None = None,
    ) -> None:
        self.policy, self.rank, self.world_size = policy, rank, world_size
        self.directory = Path(directory)
        self.backend = backend
        self.poll_s = poll_s if poll_s is not None else min(2.0, max(0.05, policy.floor_s / 20))
        self.grace_s = grace_s
        self._exit = exit
        self._global_step = global_step
        self._store = store
        self._prefix = f"lightning_scale/hang/{namespace if namespace is not None else next(_GENERATIONS)}/"
        self._beat: _Beat | None = None
        # (the beat it belongs to, the phase, when it was entered): a plain tuple, the cheapest atomic store
        self._phase: tuple[_Beat | None, str, float] = (None, PHASES[0], 0.0)
        self._last_end = time.monotonic()
        self._started = 0  # batches started in this fit
        self._completed = steps_before  # steps finished in this run (a resumed fit's count its checkpoint's)
        self._untimed = untimed
        self._untimed_seen = -math.inf  # the watchdog thread's last look that found `untimed()` true
        self._recent: deque[float] = deque(maxlen=policy.window)
        self._training_thread: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.declared: str | None = None  # who detected the hang this rank handled
        self.record: dict[str, Any] | None = None  # this rank's record of it

    # ------------------------------------------------------------------ the heartbeat (the training loop)

    def step_started(self, global_step: int | None = None) -> None:
        """A batch starts. A step still running (no :meth:`step_finished`: beats from a strategy, which has no
        batch end) ends here. ``global_step``: None reads it from ``global_step`` when a hang is reported."""
        now = time.monotonic()
        beat = self._beat
        if beat is not None:
            self._finished(beat, now)
        self._training_thread = threading.get_ident()
        self._beat = _Beat(self._started, global_step, now)
        self._started += 1

    def entered(self, phase: str) -> None:
        """``phase``: one of :data:`~lightning_scale.core.resilience.hang_report.PHASES` within the step."""
        self._phase = (self._beat, phase, time.monotonic())

    def step_finished(self) -> None:
        beat, self._beat = self._beat, None
        self._last_end = now = time.monotonic()
        if beat is not None:
            self._finished(beat, now)

    def _finished(self, beat: _Beat, now: float) -> None:
        if self._completed >= self.policy.warmup_steps:
            self._recent.append(now - max(beat.step_started, self._untimed_seen))  # what was timed of it
        self._completed += 1

    def pause(self) -> None:
        """Outside the training steps (validation, the end of an epoch): nothing is timed."""
        self._beat = None
        self._last_end = time.monotonic()

    @classmethod
    def for_process(
        cls,
        policy: HangTimeout,
        *,
        rank: int,
        world_size: int,
        directory: str | os.PathLike,
        grace_s: float = 20.0,
        **kwargs: Any,
    ) -> StepWatchdog:
        """A watchdog for this process: its ranks meet in the default process group's store (when there is
        one and more than one rank), the backend read from it; ``kwargs``: the constructor's others."""
        grouped = dist.is_available() and dist.is_initialized()
        return cls(
            policy,
            rank=rank,
            world_size=world_size,
            directory=directory,
            store=default_store() if grouped and world_size > 1 else None,
            backend=dist.get_backend() if grouped else None,
            grace_s=grace_s,
            **kwargs,
        )

    # ------------------------------------------------------------------ the thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lightning-scale-hang-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.poll_s + 5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.check():
                return

    def _read_step(self) -> int | None:
        try:
            return int(self._global_step()) if self._global_step is not None else None
        except Exception:  # noqa: BLE001 - the report goes on without it
            return None

    def limit(self) -> float:
        """Seconds the current step may run."""
        return self.policy.limit(self._completed, list(self._recent))

    def _is_untimed(self) -> bool:
        try:
            return self._untimed is not None and bool(self._untimed())
        except Exception:  # noqa: BLE001 - a state read racing the training loop: time the step
            return False

    def check(self, now: float | None = None) -> bool:
        """One look; True when a hang was handled (the process then exits, unless ``exit`` returns)."""
        now = time.monotonic() if now is None else now
        if self._is_untimed():
            self._untimed_seen = now
        beat = self._beat
        running = now - max(beat.step_started, self._untimed_seen) if beat is not None else 0.0
        if beat is not None and running > (limit := self.limit()):
            reason = f"rank {self.rank} (batch {beat.batch} ran {running:.1f} s, limit {limit:.1f} s)"
            if not self._store_call("check", ["detected"]):
                self._store_call("set", "detected", reason)  # before "declared": whoever sees that can read this
            self._store_call("add", "declared", 1)
            self._handle(reason, now)
            return True
        if self._store is not None and self._store_call("check", ["declared"]):
            self._handle(self._get("detected") or "another rank", now)
            return True
        return False

    # ------------------------------------------------------------------ the store (every call may fail: its host may be gone)

    def _store_call(self, op: str, key: str | list[str], *args: Any) -> Any:
        if self._store is None:
            return 1 if op == "add" else None
        keys = [self._prefix + k for k in key] if isinstance(key, list) else self._prefix + key
        try:
            value = getattr(self._store, op)(keys, *args)
        except Exception:  # noqa: BLE001 - an unreachable store: each rank goes on with what it knows
            return None
        return value.decode() if isinstance(value, bytes) else value

    def _get(self, key: str) -> str | None:
        """The value of ``key``, or None when it is not there (``get`` would block until it is)."""
        return self._store_call("get", key) if self._store_call("check", [key]) else None

    def _wait_for(self, done: Callable[[], bool], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            time.sleep(min(self.poll_s, 0.2))

    # ------------------------------------------------------------------ a hang: report, summarise, exit

    def _record(self, now: float) -> dict[str, Any]:
        beat = self._beat
        owner, phase, started = self._phase
        if beat is None:  # between two steps
            phase, started = PHASES[-1], self._last_end
        elif owner is not beat:  # no phase entered in this step yet
            phase, started = PHASES[0], beat.step_started
        return {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "batch": beat.batch if beat is not None else self._started - 1,
            "global_step": (beat.global_step if beat.global_step is not None else self._read_step())
            if beat is not None
            else None,
            "phase": phase,
            "phase_s": round(now - started, 3),
            "step_s": round(now - beat.step_started, 3) if beat is not None else None,
            "limit_s": round(self.limit(), 3),
            "where": innermost_frame(self._training_thread),
            "collective": waiting_collective(self._training_thread),  # the collective it waits in, from its stack
            "unix_s": round(
                time.time() - (time.monotonic() - now), 3
            ),  # when `now` was: goodput dates the hung step by it
        }

    def _handle(self, detected: str, now: float) -> None:
        self.declared = detected
        record = self._record(now)
        nccl = "nccl" in (self.backend or "")
        trace, enqueued = flight_recorder(nccl=nccl) if nccl or os.environ.get("TORCH_FR_BUFFER_SIZE") else (None, {})
        record["collectives"] = enqueued
        self.record = record
        stacks = thread_stacks(self._training_thread, skip=threading.get_ident())
        text = f"Hang detected by {detected}.\nThis rank: {json.dumps(record)}\n\n{stacks}"
        if trace is not None:
            text += f"\n--- flight recorder ({'NCCL' if nccl else 'CPU'}), JSON:\n{trace}\n"
        path = self.directory / f"rank{self.rank}.txt"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as err:
            print(f"lightning-scale hang watchdog: cannot write {path}: {err}", file=sys.stderr, flush=True)
        self._store_call("set", f"record/{self.rank}", json.dumps(record))
        print(
            f"lightning-scale hang watchdog: hang detected by {detected}; rank {self.rank} wrote {path}",
            file=sys.stderr,
            flush=True,
        )
        self._summarise(detected)
        self._store_call("add", "exited", 1)
        if self.rank == 0:  # it may serve the store: the others leave first
            reported = len(self._records())
            self._wait_for(lambda: (self._store_call("add", "exited", 0) or 0) >= reported, 5.0)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        self._exit(HANG_EXIT_CODE)

    def _records(self) -> dict[int, dict[str, Any]]:
        found: dict[int, dict[str, Any]] = {}
        for rank in range(self.world_size if self._store is not None else 0):
            value = self._get(f"record/{rank}")
            if value:
                found[rank] = json.loads(value)
        return found

    def _summarise(self, detected: str) -> None:
        """The first rank to see every record (or whose wait ran out) writes the summary; the others wait for it."""
        self._wait_for(lambda: self._store is None or len(self._records()) == self.world_size, self.grace_s)
        if self._store_call("add", "summary_claim", 1) not in (1, None):  # None: no store to share, write it here
            self._wait_for(lambda: bool(self._store_call("check", ["summary"])), self.grace_s)
            return
        records = self._records()
        if not records and self.record is not None:
            records = {self.rank: self.record}
        text = summary_text(
            records, self.world_size, detected=detected, exit_code=HANG_EXIT_CODE, directory=str(self.directory)
        )
        event = {
            "event": "hang",
            "time": time.time(),
            "detected": detected,
            "exit_code": HANG_EXIT_CODE,
            "laggards": sorted(laggards(records, self.world_size)),
            "records": {str(r): v for r, v in records.items()},
        }
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / "summary.txt").write_text(text)
            with open(self.directory / "events.jsonl", "a") as events:
                events.write(json.dumps(event) + "\n")
        except OSError as err:
            print(
                f"lightning-scale hang watchdog: cannot write the summary in {self.directory}: {err}", file=sys.stderr
            )
        print(
            f"lightning-scale hang watchdog: summary ({self.directory / 'summary.txt'}):\n{text}",
            file=sys.stderr,
            flush=True,
        )
        self._store_call("set", "summary", str(self.directory / "summary.txt"))
