"""CPU threads per process when several processes share a host.

torch sizes its intra-op pool for a process that has the host to itself (one thread per core). Two ranks
on two cores then run four busy threads: every kernel waits for a core, the backward about 2.5x slower and
AdamW's foreach kernels about 8x (issue 39). Lightning's own launchers give each process
``cores // processes`` threads when ``OMP_NUM_THREADS`` is unset, but only in the process that calls the
launcher's ``launch``: processes a launcher did not start for this strategy (torchrun's, SLURM's, the
children of Lightning's script launcher) are left at torch's default. :func:`share_cores` does the same for
every process, from the strategy's ``setup_environment``.

A user's choice stands: ``OMP_NUM_THREADS`` in the environment, or ``torch.set_num_threads`` called in the
script after importing the package (detected as a thread count other than the one torch had when this module
was imported; a count set before that import is indistinguishable from torch's default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["ThreadChoice", "cores_available", "share_cores"]

_THREADS_AT_IMPORT = torch.get_num_threads()
"""torch's intra-op pool as it was when the package was imported: torch's default unless the script had
already chosen one."""


def cores_available() -> int:
    """The cores this process may run on (its CPU affinity, as a scheduler such as SLURM restricts it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ThreadChoice:
    """What the user chose for this process's threads, seen before any launcher changed them."""

    environment: bool
    """``OMP_NUM_THREADS`` was exported."""
    threads: int | None
    """The count the script set with ``torch.set_num_threads`` (None: it set none)."""

    @classmethod
    def now(cls) -> ThreadChoice:
        threads = torch.get_num_threads()
        return cls("OMP_NUM_THREADS" in os.environ, threads if threads != _THREADS_AT_IMPORT else None)


def share_cores(processes_per_host: int, choice: ThreadChoice | None = None) -> int | None:
    """Give this process ``cores // processes_per_host`` intra-op threads (at least one) and export the
    count as ``OMP_NUM_THREADS`` for the processes it starts (data loader workers); return it. Unless the
    user chose (``choice``, taken before Lightning's launcher ran; default: now): an exported
    ``OMP_NUM_THREADS`` is left to torch, a script's ``torch.set_num_threads`` is restored (Lightning's
    launcher overrides it in the process that launches), and ``None`` is returned."""
    if not isinstance(processes_per_host, int) or isinstance(processes_per_host, bool) or processes_per_host < 1:
        raise ValueError(
            f"processes_per_host={processes_per_host!r}: the processes sharing this host's cores must be a "
            "positive integer (the strategy's processes per node)."
        )
    choice = choice or ThreadChoice.now()
    if choice.environment:
        return None
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
        return None
    threads = max(1, cores_available() // processes_per_host)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads
