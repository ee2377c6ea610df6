"""Full state dicts of a parallelised model and its optimizer.

Every tensor is gathered whole (DTensor shards over tensor parallelism, and every pipeline stage's
parameters) under the original parameter names, so a checkpoint saved at one layout loads at any
other. Collectives: every rank must call these. ``HybridParallelStrategy`` uses them for
Lightning's checkpoint path (``Trainer.save_checkpoint``/``ckpt_path``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["full_model_state", "full_optimizer_state", "load_full_model_state", "load_full_optimizer_state"]

_FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)
_FULL = StateDictOptions(full_state_dict=True)


def _gather_stages(local: Any, pp_group: ProcessGroup) -> list[Any]:
    """Every pipeline stage's piece (stages hold disjoint parameters), on every rank."""
    parts: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, local, group=pp_group)
    return parts


def full_model_state(module: nn.Module, pp_group: ProcessGroup | None = None) -> dict[str, Any]:
    """The whole model's state dict on CPU; ``pp_group``: the pipeline stages to merge (None: no pipeline)."""
    if pp_group is None:
        return get_model_state_dict(module, options=_FULL_ON_CPU)
    local = get_model_state_dict(module, options=_FULL)
    return {k: v for part in _gather_stages({k: v.cpu() for k, v in local.items()}, pp_group) for k, v in part.items()}


def load_full_model_state(module: nn.Module, state: Mapping[str, Any], *, strict: bool = True, partial: bool = False) -> None:
    """Load a whole-model state dict; ``partial``: a pipeline stage takes the entries it holds.

    Each rank copies its own shard out of each whole tensor, with no communication, one tensor at a
    time: from a memory-mapped checkpoint a rank reads only the pages of what it keeps.
    """
    held = module.state_dict()  # this rank's tensors, sharing storage with its parameters and buffers
    missing = [k for k in held if k not in state]
    unexpected = [] if partial else [k for k in state if k not in held]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing[:10]}, "
            f"unexpected keys {unexpected[:10]}. Pass strict=False to load the matching entries only."
        )
    others: dict[str, Any] = {}
    with torch.no_grad():
        for name, target in held.items():
            if name not in state:
                continue
            if not isinstance(target, Tensor):
                others[name] = state[name]  # extra state: the module's own loader
                continue
            value = state[name]
            if tuple(value.shape) != tuple(target.shape):
                raise RuntimeError(
                    f"size mismatch for {name}: copying a tensor of shape {tuple(value.shape)} from the checkpoint, "
                    f"the shape in the current model is {tuple(target.shape)}."
                )
            if isinstance(target, DTensor):
                value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None).to_local()
                target = target.to_local()
            target.copy_(value)
    if others:
        module.load_state_dict(others, strict=False)


def full_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, pp_group: ProcessGroup | None = None
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, whole tensors on CPU, merged over pipeline stages."""
    if pp_group is None:
        return get_optimizer_state_dict(module, optimizer, options=_FULL_ON_CPU)
    parts = _gather_stages(_to_cpu(get_optimizer_state_dict(module, optimizer, options=_FULL)), pp_group)
    merged: dict[str, Any] = {"state": {k: v for part in parts for k, v in part["state"].items()}, "param_groups": []}
    for groups in zip(*(part["param_groups"] for part in parts), strict=True):
        merged["param_groups"].append({**groups[0], "params": [n for g in groups for n in g["params"]]})
    return merged


def load_full_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any], *, partial: bool = False
) -> None:
    """Load a state from :func:`full_optimizer_state`; ``partial``: keep the parameters this stage holds."""
    if partial:
        held = set(module.state_dict())
        state = {
            "state": {k: v for k, v in state["state"].items() if k in held},
            "param_groups": [{**g, "params": [n for n in g["params"] if n in held]} for g in state["param_groups"]],
        }
    set_optimizer_state_dict(module, optimizer, dict(state), options=_FULL)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
