"""A run's end leaves no process-group thread to the interpreter's exit (where one aborted a
finished run: "terminate called without an active exception", status 134)."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_scale.core.parallel.process_groups import communication_threads, end_process_groups


def _mesh_run_then_end(rank: int, world_size: int) -> dict[str, list[str]]:
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    weight = distribute_tensor(torch.randn(8, 8), mesh["tp"], [Shard(0)])
    (weight @ weight).full_tensor()  # collectives on the tensor-parallel group
    # A DDP module a run that raised left alive, held where the collector cannot see it (as a Lightning
    # trainer was after a preemption): a reference count no Python object accounts for.
    ddp = DistributedDataParallel(torch.nn.Linear(4, 4), process_group=mesh.get_group("dp"))
    ddp(torch.randn(2, 4)).sum().backward()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(ddp))
    del ddp
    during = communication_threads()
    dist.barrier()
    dist.destroy_process_group()  # torch's own references go; the meshes still hold the groups
    gc.collect()
    after_destroy = communication_threads()
    left = end_process_groups(barrier=False)
    return {"during": during, "after_destroy": after_destroy, "left": left, "now": communication_threads()}


def test_ending_the_process_groups_joins_their_threads_that_destroy_alone_leaves_to_the_exit() -> None:
    for threads in run_distributed(_mesh_run_then_end, 2, timeout=60):
        assert any(name.startswith("pt_gloo_runloop") for name in threads["during"])
        # The mechanism behind the exit abort: the meshes (alive in DTensor specs) keep the groups.
        assert threads["after_destroy"], (
            "destroy_process_group alone now joins the threads: end_process_groups may shrink"
        )
        assert threads["left"] == [] and threads["now"] == []


_EXIT_SCRIPT = """
import atexit, json, sys
import torch, torch.distributed as dist
from lightning_scale.core.parallel.process_groups import communication_threads, end_at_exit
atexit.register(lambda: print("EXIT-THREADS", json.dumps(communication_threads()), flush=True))  # runs last
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 1), rank=0, world_size=1)
end_at_exit()
end_at_exit()  # once per process
dist.all_reduce(torch.ones(4))
if sys.argv[1] == "raise":
    raise RuntimeError("the run failed")
"""


@pytest.mark.parametrize("ending", ["normal", "raise"])
def test_a_process_that_never_destroys_its_groups_has_them_ended_at_exit_unless_it_raised(
    ending: str, tmp_path: Path
) -> None:
    # A user's script under HybridParallelStrategy (its init_world calls end_at_exit) seldom destroys the
    # groups; after an uncaught exception they are left alone (a peer may still be in a collective with it).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", _EXIT_SCRIPT, ending, str(tmp_path / "store")]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    threads = json.loads(proc.stdout.split("EXIT-THREADS", 1)[1])
    assert (proc.returncode == 0) == (ending == "normal"), proc.stderr[
        -3000:
    ]  # (raised: 1, or an abort left to chance)
    assert (threads == []) if ending == "normal" else any(t.startswith("pt_gloo_runloop") for t in threads), threads
    assert proc.stderr.count("Traceback") == (ending == "raise"), proc.stderr[-3000:]  # one handler, no failure
