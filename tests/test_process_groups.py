"""A run's end leaves no process-group thread to the interpreter's exit (where one aborted a
finished run: "terminate called without an active exception", status 134)."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from helpers.distributed import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_scale.core.parallel.process_groups import communication_threads, end_process_groups


def _mesh_run_then_end(rank: int, world_size: int) -> dict[str, list[str]]:
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    weight = distribute_tensor(torch.randn(8, 8), mesh["tp"], [Shard(0)])
    (weight @ weight).full_tensor()  # collectives on the tensor-parallel group
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
        assert threads["after_destroy"], "destroy_process_group alone now joins the threads: end_process_groups may shrink"
        assert threads["left"] == [] and threads["now"] == []
