"""Writing the goodput ledger (:mod:`.goodput` reads it): events appended a whole line at a time, and a thread
that rewrites the attempt's progress file, so that a SIGKILLed attempt's last sign of life is known to within
its period without any file write on the training thread.

Events are rare (an attempt's start, its first step, each checkpoint save, its end) and appended by the
training thread with one ``write`` of an ``O_APPEND`` descriptor each: a kill leaves whole lines, or at worst a
last line cut short, which the reader skips. The progress file is written to a temporary sibling and renamed
over the old one, by a daemon thread that reads the step from an attribute the training loop stores.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning_scale.core.checks import check_positive_number
from lightning_scale.core.resilience.goodput import EVENTS_FILE, GOODPUT_DIR, PROGRESS_PREFIX, parse_event

__all__ = ["ProgressWriter", "append_event", "process_start_time"]

_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """When this process started, in Unix seconds, to about 10 ms: from ``/proc/self/stat`` and ``/proc/uptime``
    (Linux; the boot time in ``/proc/stat`` has whole seconds only); elsewhere, when this module was imported."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        started_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime; the name may hold spaces
        return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


def ledger_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / GOODPUT_DIR


def append_event(run_dir: str | os.PathLike, event: Mapping[str, Any]) -> dict[str, Any]:
    """Append ``event`` (checked as the reader will: :func:`~.goodput.parse_event`) to ``run_dir``'s ledger in one
    write; returns it as parsed."""
    parsed = parse_event(dict(event))
    directory = ledger_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(dict(event)) + "\n").encode()
    fd = os.open(directory / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return parsed


class ProgressWriter:
    """A daemon thread that rewrites ``<run_dir>/goodput/progress-<attempt>.json`` every ``period_s`` seconds with
    the attempt's step and the time it was seen alive. ``step``: a number the training loop updates (:attr:`step`),
    or a function the thread calls to read it (nothing for the loop to do per step). ``stop()`` writes it once
    more and joins the thread."""

    def __init__(
        self, run_dir: str | os.PathLike, attempt: str, *, step: int | Callable[[], int] = 0, period_s: float = 1.0
    ) -> None:
        self.period_s = check_positive_number("progress_s", period_s, unit="seconds")
        self.path = ledger_dir(run_dir) / f"{PROGRESS_PREFIX}{attempt}.json"
        self.attempt = attempt
        self.step = step
        self._last_step = 0 if callable(step) else step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        self._thread = threading.Thread(target=self._run, name="lightning-scale-goodput", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.period_s + 5.0)
            self.write()

    def write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps({"attempt": self.attempt, "step": self._read_step(), "time": time.time()}))
            os.replace(tmp, self.path)
        except OSError:  # a full or vanished disk: the ledger loses precision, training goes on
            pass

    def _read_step(self) -> int:
        if not callable(self.step):
            return self.step
        try:
            self._last_step = int(self.step())
        except Exception:  # noqa: BLE001 (what it reads may be torn down as the run ends: the last step read stands)
            pass
        return self._last_step

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.write()
