"""Elastic world size: what torchrun's rendezvous gave this attempt, and the checks that keep a run whose
world changes between restarts (``torchrun --nnodes=MIN:MAX``) from training anything but what a fixed-size
run would."""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["check_launched_world", "launched_sizes"]

_TORCHRUN_SIZES = ("GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", "WORLD_SIZE")


def launched_sizes(environ: Mapping[str, str] | None = None) -> dict[str, int] | None:
    """``{"num_nodes": ..., "devices": ...}`` of this torchrun attempt (``GROUP_WORLD_SIZE``: the agents that
    joined the rendezvous; ``LOCAL_WORLD_SIZE``: this node's processes), for ``Trainer(**launched_sizes())``:
    under ``--nnodes=MIN:MAX`` they change from one restart to the next. ``None`` outside torchrun."""
    env = os.environ if environ is None else environ
    if not all(name in env for name in _TORCHRUN_SIZES):
        return None
    nodes, per_node, world = (int(env[name]) for name in _TORCHRUN_SIZES)
    if nodes * per_node != world:  # nodes with different --nproc-per-node: no single `devices` describes them
        return None
    return {"num_nodes": nodes, "devices": per_node}


def check_launched_world(world_size: int, *, num_nodes: int, devices_per_node: int) -> None:
    """``ValueError`` unless the Trainer's ``num_nodes x devices`` is the world the launcher started.

    Lightning checks this for its own strategies under torchrun; a strategy whose processes an external
    launcher started must too, or a layout, an hsdp split or a plan is made for a world that is not there."""
    if num_nodes * devices_per_node == world_size:
        return
    launched = launched_sizes()
    hint = (
        f"This attempt of torchrun has num_nodes={launched['num_nodes']} x devices={launched['devices']}: pass "
        "Trainer(**lightning_scale.core.resilience.launched_sizes(), ...), which reads them from torchrun's "
        "environment at every (re)start, as an elastic launch (--nnodes=MIN:MAX) needs."
        if launched is not None
        else "Pass the launcher's numbers of nodes and processes per node."
    )
    raise ValueError(
        f"Trainer(num_nodes={num_nodes}, devices={devices_per_node}) makes {num_nodes * devices_per_node} processes, "
        f"but the launcher started {world_size} (WORLD_SIZE). {hint}"
    )
