"""Loading a whole-model state (a ``torch.save`` checkpoint file, e.g. from a single-device run) into a
parallelised model and its optimizer: each rank copies out what it holds, with no communication.

Saving never gathers the whole state: ``HybridParallelStrategy`` writes sharded checkpoints
(:mod:`lightning_scale.core.checkpoint.sharded`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["by_parameter_name", "load_full_model_state", "load_full_optimizer_state"]

_FULL = StateDictOptions(full_state_dict=True)


def load_full_model_state(
    module: nn.Module, state: Mapping[str, Any], *, strict: bool = True, partial: bool = False
) -> None:
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


def load_full_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any], *, partial: bool = False
) -> None:
    """Load a whole optimizer state: keyed by parameter name (``get_optimizer_state_dict`` with
    ``full_state_dict=True``, as earlier releases saved it) or torch's own ``optimizer.state_dict()``,
    keyed by position (what a single-device Lightning run saves; see :func:`by_parameter_name`);
    ``partial``: keep the parameters this stage holds."""
    state = by_parameter_name(module, optimizer, state, partial=partial)
    if partial:
        held = set(module.state_dict())
        state = {
            "state": {k: v for k, v in state["state"].items() if k in held},
            "param_groups": [{**g, "params": [n for n in g["params"] if n in held]} for g in state["param_groups"]],
        }
    set_optimizer_state_dict(module, optimizer, dict(state), options=_FULL)


def by_parameter_name(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any], *, partial: bool = False
) -> Mapping[str, Any]:
    """``state`` keyed by parameter name. torch's ``optimizer.state_dict()`` numbers the parameters in
    the order of its ``param_groups``; a group's ``param_names`` (torch >= 2.6, when the optimizer was
    given named parameters) name them, else the ``optimizer`` built by the same ``configure_optimizers``
    on this whole ``module`` does: its groups list the same parameters in the same order. A pipeline
    stage (``partial``) holds only some of them, so the positions cannot be matched there."""
    groups = state["param_groups"]
    positions = [p for g in groups for p in g["params"]]
    if all(isinstance(p, str) for p in positions):
        return state
    if groups and all(len(g.get("param_names", ())) == len(g["params"]) for g in groups):
        names = {p: n for g in groups for p, n in zip(g["params"], g["param_names"])}
    else:
        if partial:
            raise ValueError(
                "The checkpoint's optimizer state is torch's own (parameters numbered by their position in "
                "configure_optimizers' groups, no names), and this pipeline stage holds only some of the parameters, "
                "so the numbers cannot be matched to them. Resume it once with pipeline_parallel=1 (any data or tensor "
                "parallel size) and save: that checkpoint resumes at every layout."
            )
        live = optimizer.param_groups
        sizes, live_sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in live]
        if sizes != live_sizes:
            raise ValueError(
                f"The checkpoint's optimizer state has parameter groups of {sizes} parameters and configure_optimizers "
                f"built groups of {live_sizes}: its state is numbered by position, so the groups must be the same. "
                "Build the optimizer as the run that saved it did."
            )
        fqn = {id(p): n for n, p in module.named_parameters()}
        names = {p: fqn[id(t)] for g, lg in zip(groups, live) for p, t in zip(g["params"], lg["params"])}
    return {
        "state": {names[p]: v for p, v in state["state"].items()},
        "param_groups": [
            {**{k: v for k, v in g.items() if k != "param_names"}, "params": [names[p] for p in g["params"]]}
            for g in groups
        ],
    }
