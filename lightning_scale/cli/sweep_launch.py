"""Starting a sweep job's ranks and watching them: ``torchrun`` with the job's resolved config, a
status line every ``sweep.progress_every_s`` seconds, and nothing of the job left running when it ends.
May import from ``cli`` ``environment`` and ``job_config`` (see ``cli/__init__.py``).

A job's processes die with the sweep, on any signal including SIGKILL: the torchrun agent and every
rank ask the kernel for SIGKILL when their parent dies (``PR_SET_PDEATHSIG``), and a reaper that
outlives the sweep SIGKILLs every other process carrying the job's id in its environment (wandb's
helpers) once the sweep's pipe to it closes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lightning_scale.cli.environment import (
    ORPHAN_WATCH_ENV,
    RESOLVED_CONFIG_ENV,
    die_with_parent,
    global_rank,
    libc_prctl,
)
from lightning_scale.cli.job_config import devices_per_node

__all__ = ["JOB_ID_ENV", "LOG_FILE", "PROGRESS_EVERY_S", "say", "tail", "torchrun"]

LOG_FILE = "job.log"
"""A sweep job's log, in its directory: torchrun's and every rank's output."""


def say(message: str) -> None:
    """One line of the sweep's own output (global rank 0 only)."""
    if global_rank() == 0:
        print(f"[sweep] {message}", flush=True)


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def torchrun(
    cfg: DictConfig,
    config_file: Path,
    log: Path,
    label: str = "job",
    *,
    watch: Callable[[], bool] | None = None,
    poll_s: float | None = None,
) -> int:
    """Run one job's ranks under ``torchrun`` (its log: ``log``) and return its exit status. ``watch`` is
    called every ``poll_s`` seconds (default ``sweep.progress_every_s``) while the job runs, instead of the
    progress line: when it returns True the job is sent SIGTERM once (it commits a checkpoint at the step it
    stops at and exits with status 143)."""
    trainer = cfg.trainer
    nproc = devices_per_node(cfg)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env[RESOLVED_CONFIG_ENV] = str(config_file)
    env[ORPHAN_WATCH_ENV] = "1"  # torchrun puts each rank in a session of its own: see watch_parent
    if str(trainer.get("accelerator", "cpu")) == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "lightning_scale.cli.train",
    ]
    sweep_pid = os.getpid()
    job_id = f"{sweep_pid}-{time.monotonic_ns()}"
    env[JOB_ID_ENV] = job_id  # every process of the job inherits it: what the reaper looks for
    reaper = _start_reaper(job_id)
    try:
        return _run_agent(cfg, command, env, log, label, sweep_pid, watch=watch, poll_s=poll_s)
    finally:
        _stop_reaper(reaper)


JOB_ID_ENV = "LIGHTNING_SCALE_SWEEP_JOB"
# The reaper: a tiny process (no imports beyond the standard library) that outlives the sweep. It blocks
# on a pipe from the sweep; at end of file (the job ended, or the sweep died, however) it SIGKILLs every
# process whose environment carries the job's id: what PR_SET_PDEATHSIG cannot reach, such as the helpers
# that wandb's service starts, which no sweep process is the parent of.
_REAPER = """
import os, signal, sys, time
mark = ("JOB_ID_ENV=" + sys.argv[1]).encode()
sys.stdin.buffer.read()
for _ in range(10):
    found = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\\0"):
                    os.kill(int(pid), signal.SIGKILL)
                    found += 1
        except OSError:
            pass
    if not found:
        break
    time.sleep(0.1)
""".replace("JOB_ID_ENV", JOB_ID_ENV)


def _start_reaper(job_id: str) -> subprocess.Popen[bytes] | None:
    if not Path("/proc").is_dir():
        return None
    env = {k: v for k, v in os.environ.items() if k != JOB_ID_ENV}
    return subprocess.Popen(
        [sys.executable, "-S", "-c", _REAPER, job_id], stdin=subprocess.PIPE, env=env, start_new_session=True
    )


def _stop_reaper(reaper: subprocess.Popen[bytes] | None) -> None:
    if reaper is not None and reaper.stdin is not None:
        reaper.stdin.close()  # end of file: it ends what is left of the job, then exits
        try:
            reaper.wait(timeout=10)
        except subprocess.TimeoutExpired:
            reaper.kill()


def _run_agent(
    cfg: DictConfig,
    command: list[str],
    env: dict[str, str],
    log: Path,
    label: str,
    sweep_pid: int,
    *,
    watch: Callable[[], bool] | None = None,
    poll_s: float | None = None,
) -> int:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        # The agent dies with this process (SIGKILL included); its ranks die with the agent (watch_parent).
        prctl = libc_prctl()  # loaded here: the child only calls it
        proc = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=lambda: die_with_parent(sweep_pid, prctl)
        )
        progress = _Progress(log, label, int(cfg.trainer.get("max_steps", -1)))
        every = poll_s or float(OmegaConf.select(cfg, "sweep.progress_every_s", default=PROGRESS_EVERY_S))
        stopping = False
        try:
            while True:
                try:
                    return proc.wait(timeout=every)
                except subprocess.TimeoutExpired:
                    if watch is None:
                        progress.report()
                    elif not stopping and watch():
                        stopping = True
                        proc.send_signal(signal.SIGTERM)  # torchrun passes it to every rank
        except BaseException:
            proc.kill()  # KeyboardInterrupt and the like: the job's processes go with the sweep
            proc.wait()
            raise


PROGRESS_EVERY_S = 10.0
_STEP_LINE = re.compile(r"^step (\d+)(?:/(\d+))?(.*)$")


class _Progress:
    """One status line per running job from its log's newest ``ConsoleLogger`` line: step, loss,
    tokens/s and the time left at the rate so far."""

    def __init__(self, log: Path, label: str, max_steps: int) -> None:
        self.log, self.label, self.max_steps = log, label, max_steps
        self.start = time.monotonic()
        self.first: tuple[float, int] | None = None
        self.last_step: int | None = None

    def report(self) -> None:
        line = next((ln for ln in reversed(tail(self.log, 200).splitlines()) if _STEP_LINE.match(ln)), None)
        if line is None:
            return
        match = _STEP_LINE.match(line)
        assert match is not None
        step = int(match.group(1))
        if step == self.last_step:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = (now, step)
        self.last_step = step
        fields = dict(part.strip().split(" ", 1) for part in match.group(3).split("|") if " " in part.strip())
        parts = [f"step {step}" + (f"/{self.max_steps}" if self.max_steps > 0 else "")]
        if "train/loss" in fields:
            parts.append(f"loss {float(fields['train/loss']):.4f}")
        if "train/tokens_per_sec" in fields:
            parts.append(f"{float(fields['train/tokens_per_sec']):,.0f} tokens/s")
        t0, s0 = self.first
        if self.max_steps > 0 and step > s0:
            parts.append(f"ETA {(self.max_steps - step) * (now - t0) / (step - s0):.0f} s")
        say(f"{self.label}: " + ", ".join(parts) + f" ({self.log})")
