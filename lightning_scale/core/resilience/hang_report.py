"""What a rank writes when a hang is declared, and how the summary names the stalled ranks.

Each rank's record says how far it got (its heartbeat: the batch, the phase of the step, for how long)
and, with the flight recorder on, the sequence number of the last collective it enqueued on each process
group. A rank is *behind* when another rank got further: a later phase of the same batch (ranks in
``backward`` wait in the gradient reduction that a rank still in ``forward`` never reached), or a later
collective of one process group. Where the heartbeats agree (a collective inside one phase: FSDP's
all-gathers and tensor-parallel collectives in the forward, a user's ``all_reduce``, the preemption flag's
all-reduce), the ranks' stacks tell them apart without the flight recorder: a rank whose training thread waits
in ``torch.distributed`` code (:func:`waiting_collective`) is in a collective, and a rank at the same point
that is not never entered it. A rank that wrote no record at all is named too. Pure functions of the
records: no process group, no thread.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from collections.abc import Mapping
from typing import Any

from lightning_scale.core.compat_c10d import flight_recorder_json

__all__ = [
    "PHASES",
    "describe",
    "flight_recorder",
    "innermost_frame",
    "laggards",
    "progress",
    "summary_text",
    "thread_stacks",
    "waiting_collective",
]

PHASES = ("forward", "backward", "optimizer step", "between steps")
"""The phases of a training step in the order a rank passes them (``forward`` from the batch's start,
``between steps`` once its batch ended): what the heartbeat records."""

_FLIGHT_RECORDER_TIMEOUT_S = 10.0


def thread_stacks(training_thread: int | None, *, skip: int | None = None) -> str:
    """Every Python thread's stack, innermost call last, the training loop's thread first; ``skip``: a
    thread left out (the watchdog's own)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: ident != training_thread)
    parts = []
    for ident in order:
        if ident == skip:
            continue
        label = " (the training loop)" if ident == training_thread else ""
        stack = "".join(traceback.format_stack(frames[ident]))
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}){label}, innermost call last:\n{stack}")
    return "\n".join(parts)


def innermost_frame(thread: int | None) -> str | None:
    """``file:line in function`` of the innermost Python frame of ``thread`` (None: no such thread)."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    if frame is None:
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


_DISTRIBUTED = f"{os.sep}torch{os.sep}distributed{os.sep}"
_TORCH = f"{os.sep}torch{os.sep}"


def waiting_collective(thread: int | None) -> str | None:
    """The ``torch.distributed`` call ``thread`` waits in (``"all_reduce (distributed_c10d.py:2950)"``), or
    None: its innermost frames, as long as they are torch's, include none of ``torch.distributed`` (a
    thread in its own code, or computing). A collective's wait blocks in native code called from a Python
    frame of ``torch.distributed`` (``work.wait()``), under torch's dispatcher frames at most."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    found = None
    while frame is not None and found is None and _TORCH in frame.f_code.co_filename:
        if _DISTRIBUTED in frame.f_code.co_filename:
            found = frame  # the innermost: the call that waits (not the logging wrappers around it)
        frame = frame.f_back
    if found is None:
        return None
    return f"{found.f_code.co_name} ({os.path.basename(found.f_code.co_filename)}:{found.f_lineno})"


def flight_recorder(*, nccl: bool) -> tuple[str | None, dict[str, int]]:
    """The flight recorder's trace as JSON text and, per process group id, the sequence number of the
    last collective this process enqueued (``(None, {})`` when there is no trace or it did not come within
    10 s: a dump waits for locks a stuck communicator may hold, so it runs in a thread of its own)."""
    box: list[bytes] = []

    def dump() -> None:
        try:
            box.append(flight_recorder_json(nccl=nccl))
        except Exception:  # noqa: BLE001 - a missing recorder or an error: the report goes on without it
            pass

    worker = threading.Thread(target=dump, name="lightning-scale-flight-recorder", daemon=True)
    worker.start()
    worker.join(_FLIGHT_RECORDER_TIMEOUT_S)
    if not box:
        return None, {}
    text = box[0].decode(errors="replace")
    try:
        trace = json.loads(text)
        status = trace.get("pg_status") or {}
        enqueued = {str(pg): int(s["last_enqueued_collective"]) for pg, s in status.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return text, {}
    if not trace.get("entries"):
        return None, {}  # recording is off (a buffer size of 0): nothing worth a section
    return text, enqueued


def progress(record: Mapping[str, Any]) -> tuple[int, int, bool]:
    """How far a rank got: (its batch's index in this fit, the index of its phase in :data:`PHASES`, whether
    it waits in a collective); between steps, the batch is the last one it finished (-1: none yet). At the
    same batch and phase, a rank in a collective is further than one that has not entered it."""
    return int(record["batch"]), PHASES.index(record["phase"]), bool(record.get("collective"))


def describe(record: Mapping[str, Any]) -> str:
    """Where a record's rank is, in words: ``"backward of batch 5 (global step 4) for 3.2 s"``."""
    batch, phase = int(record["batch"]), record["phase"]
    if phase == "between steps":
        where = f"between batches {batch} and {batch + 1}" if batch >= 0 else "before its first batch"
    else:
        where = f"{phase} of batch {batch} (global step {record['global_step']})"
    return f"{where} for {float(record['phase_s']):.1f} s"


def laggards(records: Mapping[int, Mapping[str, Any]], world_size: int) -> dict[int, str]:
    """The ranks that never reached the point the others wait at, each with the reason: behind another
    rank's heartbeat, behind on a process group's collectives (flight recorder), or no record at all."""
    found: dict[int, str] = {}
    if records:
        lead = max(progress(r) for r in records.values())
        ahead = sorted(rank for rank, r in records.items() if progress(r) == lead)
        leader = records[ahead[0]]
        for rank, record in sorted(records.items()):
            if progress(record) == lead[:2] + (False,) and lead[2]:  # the same point, but outside the collective
                found[rank] = (
                    f"never entered the collective rank(s) {_ranks(ahead)} wait in ({leader['collective']}), in "
                    f"{describe(leader)}; it is in {describe(record)}, at {record.get('where') or '?'}"
                )
            elif progress(record) < lead:
                found[rank] = f"{describe(record)}, while rank(s) {_ranks(ahead)} reached {describe(leader)}"
        groups = {pg for r in records.values() for pg in r.get("collectives", {})}
        for pg in sorted(groups):
            seqs = {rank: r["collectives"][pg] for rank, r in records.items() if pg in r.get("collectives", {})}
            if len(seqs) < 2:
                continue
            top = max(seqs.values())
            waiting = sorted(rank for rank, s in seqs.items() if s == top)
            for rank, seq in sorted(seqs.items()):
                if seq < top:
                    note = f"enqueued collective #{seq} of process group {pg} last; rank(s) {_ranks(waiting)} wait in #{top}"
                    found[rank] = f"{found[rank]}; {note}" if rank in found else note
    for rank in range(world_size):
        if rank not in records:
            found[rank] = (
                "wrote no record: its process is dead, unreachable, or holds the interpreter lock in native code"
            )
    return dict(sorted(found.items()))


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def summary_text(
    records: Mapping[int, Mapping[str, Any]], world_size: int, *, detected: str, exit_code: int, directory: str
) -> str:
    """The human summary: who detected the hang, the ranks that are behind (or that none is), every rank's
    heartbeat and innermost frame, and where the stacks are."""
    behind = laggards(records, world_size)
    lines = [f"Hang detected by {detected}.", ""]
    if behind:
        lines.append(f"Ranks that never reached the point the others wait at: {_ranks(sorted(behind))}")
        lines += [f"  rank {rank}: {why}" for rank, why in behind.items()]
    else:
        lines.append(
            "No rank is behind another: every rank is at the same point. Likely a collective that does not complete "
            "on any of them (network, device) or a step slower than the timeout; compare the stacks."
        )
    lines += ["", "Every rank (heartbeat; innermost frame of the training loop's thread):"]
    for rank in range(world_size):
        r = records.get(rank)
        if r is None:
            lines.append(f"  rank {rank}: no record")
            continue
        waits = f"; waits in {r['collective']}" if r.get("collective") else ""
        lines.append(f"  rank {rank} ({r['host']}, pid {r['pid']}): {describe(r)}; at {r.get('where') or '?'}{waits}")
    lines += [
        "",
        f"Stacks: {directory}/rank<k>.txt. Every process exits with status {exit_code} "
        "(lightning_scale.core.resilience.HANG_EXIT_CODE); a relaunch (torchrun --max-restarts, a requeued job) resumes from "
        '"latest".',
    ]
    return "\n".join(lines) + "\n"
