"""Run a test function in N gloo processes on CPU.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo
process group in each through a ``TCPStore`` that *this* process serves on a port the OS picked
(so there is no free-port race and no retry loop), calls ``fn(rank, world_size, *args)`` and
returns the per-rank results. The environment Lightning reads (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``) is set, so a ``Trainer(devices=world_size)``
inside ``fn`` joins the existing group instead of launching processes.

Failure modes it turns into a fast, readable test failure:
- a rank raises: the others get a few seconds to finish (a ``SystemExit`` ends the rank's process with
  its status, as outside the harness: ``exit_codes`` has it), then every rank's Python stack is
  dumped (``faulthandler`` on SIGUSR2: SIGUSR1 is SLURM's preemption warning, which
  ``PreemptionCheckpoint`` handles during fit) and the error shows the exception and all stacks;
- a hang: after ``timeout`` seconds every rank's stack is dumped and the processes are killed.
Process groups are always destroyed, processes always reaped.

Ranks are forked from a ``forkserver`` that imported torch, Lightning and this package once per
test session: a spawned rank spends ~10 s of CPU importing them (Lightning pulls in torchmetrics,
transformers and matplotlib), which on a 2-core machine was most of a small test's time. The
server never runs a torch op (so no OpenMP pool is forked), and each rank gets the parent's
environment as it is at the call, exactly as a spawned process would.
"""

from __future__ import annotations

import faulthandler
import importlib
import io
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistributedTestError", "run_cases", "run_distributed"]

_GRACE_AFTER_ERROR_S = 5.0
_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_scale", "lightning_scale.strategies"]


_ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _context() -> Any:
    """The forkserver context, its server started with one thread.

    The server must never hold a thread pool when it forks: numpy's OpenBLAS starts one at import
    unless told otherwise, and a rank forked from it crashed (SIGSEGV in a BLAS call) on CI. So
    the server starts with the ``*_NUM_THREADS=1`` a spawned rank also had, and is checked to run
    a single thread.
    """
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read once, when the server starts
    saved = {k: os.environ.get(k) for k in _ONE_THREAD}
    os.environ.update({k: "1" for k in _ONE_THREAD})
    try:
        forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return ctx


def _server_threads() -> int:
    """Threads of the running forkserver (1 once its preload finished; it forks ranks from there)."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return len(os.listdir(f"/proc/{pid}/task")) if pid and os.path.isdir(f"/proc/{pid}/task") else 1


class DistributedTestError(AssertionError):
    """A rank failed or the group hung; the message holds every rank's traceback or stack, ``exit_codes``
    each process's exit status when the harness gave up (None: still running, then killed)."""

    def __init__(self, message: str, exit_codes: dict[int, int | None] | None = None) -> None:
        super().__init__(message)
        self.exit_codes = dict(exit_codes or {})


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    stack_file: str,
    timeout: float,
    env: dict[str, str],
) -> None:
    os.environ.clear()  # the parent's environment now, not the server's at its start
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        GROUP_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    status: Any = None
    with open(stack_file, "w") as stacks:
        faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)
        faulthandler.enable(file=stacks, all_threads=True)  # a crash (SIGSEGV...) leaves its stack too
        try:
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
            )
            value = fn(rank, world_size, *args)
            # As bytes: tensors sent through a Queue travel as shared-memory handles that vanish
            # when this process exits before the parent reads them.
            buffer = io.BytesIO()
            torch.save(value, buffer)
            results.put((rank, True, buffer.getvalue()))
        except BaseException as exc:  # noqa: BLE001 - report everything, including KeyboardInterrupt/SystemExit
            results.put((rank, False, traceback.format_exc()))
            status = exc.code if isinstance(exc, SystemExit) else None
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            faulthandler.unregister(signal.SIGUSR2)
            faulthandler.disable()
    if status is not None:
        raise SystemExit(status)  # the process ends with the status it would have had outside the harness


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function of a test module).
    Raises :class:`DistributedTestError` on any rank's failure, or after ``timeout`` seconds.
    """
    ctx = _context()
    # This process serves the rendezvous store; port 0 lets the OS choose a free port atomically.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="run_distributed-") as tmp:
        stack_files = [str(Path(tmp) / f"rank{r}.stacks") for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    world_size,
                    store.port,
                    fn,
                    args,
                    results,
                    stack_files[r],
                    timeout,
                    {**os.environ, **(env or {})},
                ),
                name=f"rank{r}",
            )
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        outcome: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            threads = _server_threads()  # the preload finished: the ranks were forked
            if threads != 1:
                raise RuntimeError(f"the forkserver runs {threads} threads; a rank forked from it may crash")
            while len(outcome) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs) and len(outcome) < world_size:
                        # A rank died without reporting (segfault, os._exit): give the rest a moment.
                        deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR_S)
                    continue
                outcome[rank] = (ok, value)
                if not ok:
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR_S)
            if any(not ok for ok, _ in outcome.values()):
                for rank in outcome:  # a rank that reported its failure ends by itself: its status is read
                    procs[rank].join(timeout=max(0.1, deadline - time.monotonic()))
            exit_codes = {r: p.exitcode for r, p in enumerate(procs)}  # before we kill the stragglers
            stacks = _collect_stacks(procs, stack_files) if len(outcome) < world_size else {}
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=10)
            results.close()
            del store

    failures = {r: v for r, (ok, v) in outcome.items() if not ok}
    if failures or len(outcome) < world_size:
        lines = [f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size}) failed:"]
        for rank in range(world_size):
            if rank in failures:
                lines.append(f"--- rank {rank} raised:\n{failures[rank]}")
            elif rank not in outcome:
                code = exit_codes[rank]
                state = "hung" if code is None else f"exited with code {code}"
                lines.append(f"--- rank {rank} did not finish ({state}); its stack:\n{stacks.get(rank, '(none)')}")
        if len(outcome) < world_size and not failures and None in exit_codes.values():
            lines.insert(1, f"timed out after {timeout:.0f} s")
        raise DistributedTestError("\n".join(lines), exit_codes)
    return [torch.load(io.BytesIO(outcome[r][1]), weights_only=False) for r in range(world_size)]


def _collect_stacks(procs: list[Any], stack_files: list[str]) -> dict[int, str]:
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGUSR2)
    time.sleep(1.0)
    stacks = {}
    for rank, path in enumerate(stack_files):
        try:
            stacks[rank] = Path(path).read_text().strip() or "(no stack written)"
        except OSError:
            stacks[rank] = "(no stack file)"
    return stacks


def run_cases(rank: int, world_size: int, module: str, table: str) -> dict[str, Any]:
    """For :func:`run_distributed`: run every case of the table ``{name: fn(world_size)}`` named
    ``table`` in test module ``module`` (by name: lambdas do not pickle), in one spawn.

    Several runs of one world size in one spawn pay for one process start-up; a test module keeps
    the result in a fixture and each test checks its own case.
    """
    cases = getattr(importlib.import_module(module), table)
    return {name: run(world_size) for name, run in cases.items()}
