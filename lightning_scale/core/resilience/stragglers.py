"""The straggler action: which rank stayed slow long enough to restart without its host, and the record of it.

:class:`SlowStreaks` counts, per rank, the consecutive logging intervals it was flagged at (from figures every
rank holds alike, the all-reduced ones, so every rank reaches the same decision at the same step with no
collective of its own). :func:`record_exclusion` writes what a job script reads to relaunch without the host:
``exclude.json`` (this event, and every host excluded from the run so far) and one line of ``events.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["STRAGGLER_EXIT_CODE", "SlowStreaks", "record_exclusion"]

STRAGGLER_EXIT_CODE = 76
"""The exit status of every process after the straggler action committed its checkpoint: distinct from the
hang's 75 and the preemption's 143, so a job script tells "restart without the host in
``stragglers/exclude.json``" from "restart as it was". Non-zero: torchrun ``--max-restarts`` relaunches too."""


class SlowStreaks:
    """Consecutive logging intervals at which each rank was slower than the factor; the ratio at each.

    ``update({rank: ratio})`` takes one interval's flagged ranks and returns those flagged at ``patience``
    intervals in a row, each with its ratios in the order they came (a rank not flagged starts again at 0).
    """

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self.ratios: dict[int, list[float]] = {}

    def update(self, flagged: Mapping[int, float]) -> dict[int, list[float]]:
        self.ratios = {rank: [*self.ratios.get(rank, []), ratio] for rank, ratio in flagged.items()}
        return {rank: ratios for rank, ratios in sorted(self.ratios.items()) if len(ratios) >= self.patience}

    def count(self, rank: int) -> int:
        return len(self.ratios.get(rank, ()))


def record_exclusion(directory: str | os.PathLike, event: Mapping[str, Any], hosts: Sequence[str]) -> dict[str, Any]:
    """Write ``<directory>/exclude.json`` (``event`` and ``"exclude"``: ``hosts`` added to the ones an earlier
    exclusion in the same directory named, in order, once each) through a temporary file and a rename, and
    append ``event`` to ``<directory>/events.jsonl``. Returns what ``exclude.json`` holds."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "exclude.json"
    excluded: list[str] = []
    try:
        excluded = [str(h) for h in json.loads(path.read_text()).get("exclude", [])]
    except (OSError, ValueError, AttributeError):
        pass  # none yet (or unreadable: this event starts the list again)
    record = {**event, "time": time.time(), "exclude": list(dict.fromkeys([*excluded, *hosts]))}
    staging = directory / f".exclude.json.{os.getpid()}"
    staging.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(staging, path)
    with open(directory / "events.jsonl", "a") as events:
        events.write(json.dumps({k: v for k, v in record.items() if k != "exclude"}) + "\n")
    return record
