"""Names of tied weights in a checkpoint: one weight that several modules share (a GPT's token
embedding and output head) is stored once, under its first name, and loaded into every copy.

Plain functions of names and tensors, with no communication: :mod:`.sharded_state` applies them to
a parallelised module's state dicts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "aliases_of_groups",
    "groups_of_aliases",
    "names_under",
    "rename_optimizer_state",
    "storage_aliases",
    "with_aliases_filled",
]


def _storage(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr(), tuple(tensor.shape)


def storage_aliases(state: Mapping[str, Any]) -> dict[str, str]:
    """``{name: canonical name}`` for every tensor of ``state`` that shares its storage and shape with
    an earlier entry (the canonical name: the first, in ``state``'s order)."""
    aliases: dict[str, str] = {}
    first: dict[tuple[int, tuple[int, ...]], str] = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            key = _storage(value)
            if key in first:
                aliases[name] = first[key]
            else:
                first[key] = name
    return aliases


def aliases_of_groups(groups: Iterable[Sequence[str]], present: Iterable[str] | None = None) -> dict[str, str]:
    """``{name: group's first name}`` for every later name of each group (``present``: only those names)."""
    kept = None if present is None else set(present)
    return {n: names[0] for names in groups for n in names[1:] if kept is None or n in kept}


def groups_of_aliases(aliases: Mapping[str, str]) -> list[list[str]]:
    """The groups of names :func:`storage_aliases` found: the canonical name first, then its aliases."""
    groups: dict[str, list[str]] = {}
    for name, canonical in aliases.items():
        groups.setdefault(canonical, [canonical]).append(name)
    return list(groups.values())


def names_under(module: nn.Module, root: nn.Module, groups: Iterable[Sequence[str]]) -> list[list[str]]:
    """``groups`` of parameter names relative to ``root`` (a submodule of ``module``, or ``module``
    itself) as ``module`` names them."""
    prefix = next((n for n, m in module.named_modules() if m is root), "")
    return [[f"{prefix}.{n}" if prefix else n for n in names] for names in groups]


def with_aliases_filled(state: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """``state`` with every alias given its canonical entry (when ``state`` has it): what a module
    holding several copies of a weight stored once loads."""
    filled = dict(state)
    for name, canonical in aliases.items():
        if canonical in filled:
            filled[name] = filled[canonical]
    return filled


def rename_optimizer_state(state: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter names (DCP's) with ``names``' keys renamed to their values."""
    return {
        "state": {names.get(k, k): v for k, v in state["state"].items()},
        "param_groups": [{**g, "params": [names.get(n, n) for n in g["params"]]} for g in state["param_groups"]],
    }
