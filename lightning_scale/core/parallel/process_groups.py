"""Ending a process's distributed state so that nothing of it outlives the interpreter.

A gloo process group runs worker threads (``pt_gloo_runloop``, ``gloo_tcp_loop``) that are joined
only when the C++ group object is destroyed, i.e. when its last reference goes.
``dist.destroy_process_group()`` drops torch's own references, but every ``DeviceMesh`` keeps the
groups of its dimensions in ``_pg_registry``, and meshes live on in DTensor specs and sharding
caches until the interpreter exits. A worker still releasing a collective's tensors then takes the
GIL of an interpreter that is finalising; Python ends that thread with a forced unwind through a
``noexcept`` frame and the process aborts ("terminate called without an active exception",
status 134) after a run that succeeded, and torchrun counts a failed rank (pytorch #190489). A strategy that
sets up a mesh therefore calls :func:`end_at_exit`.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import sys
import time

import torch.distributed as dist

from lightning_scale.core.compat import mesh_group_registry

__all__ = ["COMMUNICATION_THREADS", "communication_threads", "end_at_exit", "end_process_groups"]

COMMUNICATION_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_nccl_watchdg", "pt_nccl_heartbt")
"""Name prefixes (Linux thread names, 15 characters at most) of the C++ threads a process group runs."""

_GRACE_S = 3.0
"""How long :func:`end_process_groups` waits for groups released just after it destroyed them."""


_DDP_GROUP_HOLDERS = ("reducer", "logger", "process_group")
"""A ``DistributedDataParallel``'s attributes that hold its process group (the reducer and its logger hold it in C++)."""


def communication_threads() -> list[str]:
    """Names of this process's process-group threads still running (Linux; empty where
    ``/proc/self/task`` cannot be read)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # the thread ended while we looked
        if name.startswith(COMMUNICATION_THREADS):
            names.append(name)
    return sorted(names)


def end_process_groups(*, barrier: bool) -> list[str]:
    """Destroy every process group and release the references meshes hold, so the groups' worker
    threads are joined now; returns the names of any still running (see :func:`communication_threads`).

    ``barrier``: first wait until every rank got here (no rank is still in a collective of the run);
    only where every rank is known to call this (a run that finished, not one that raised).
    """
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    if dist.is_available():
        from torch.distributed.device_mesh import DeviceMesh
        from torch.nn.parallel import DistributedDataParallel

        for obj in gc.get_objects():
            # By type, not isinstance: DeviceMesh's metaclass reads the object's attributes, and one of the
            # objects alive is torch's deprecated `dist.reduce_op`, which warns when read.
            if issubclass(type(obj), DeviceMesh):
                registry = mesh_group_registry(obj)
                if registry is not None:
                    registry.clear()
            elif issubclass(type(obj), DistributedDataParallel):
                # A run that raised can leave its DDP module alive, held where the collector cannot see
                # (a reference from C++): its reducer and group would keep the group's threads running.
                for name in _DDP_GROUP_HOLDERS:
                    obj.__dict__.pop(name, None)
        gc.collect()
    # A group whose last reference goes a moment later (a background thread finishing an async
    # checkpoint's collective, a Work being released) joins its threads then: wait for that, briefly.
    deadline = time.monotonic() + _GRACE_S
    left = communication_threads()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
        left = communication_threads()
    return left


@functools.cache
def end_at_exit() -> None:
    """Have :func:`end_process_groups` (no barrier) run when this process exits, while the interpreter
    is still alive (``atexit``; once per process). For a user's own script, which seldom destroys the
    groups, and never the ones a mesh holds. Not after an uncaught exception: a peer may still be in a
    collective with this rank, and ending a group may wait for its work (torchtitan #1342 skips it too);
    nor after ``os._exit`` (the hang watchdog's exit), which runs no handler."""
    atexit.register(_end_at_exit)


def _end_at_exit() -> None:
    if getattr(sys, "last_value", None) is not None:  # set when the interpreter printed an uncaught exception
        return
    try:
        end_process_groups(barrier=False)
    except Exception as err:  # noqa: BLE001 - the run is over: say why, and leave the exit status alone
        print(f"lightning-scale: ending the process groups at exit failed: {err!r}", file=sys.stderr, flush=True)
