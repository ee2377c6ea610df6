"""Questions about a module tree that tensor and pipeline parallelism both ask."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from torch import nn

__all__ = ["outermost_registered", "tied_parameter_groups"]

T = TypeVar("T")


def outermost_registered(root: nn.Module, registry: Mapping[type[nn.Module], T]) -> list[tuple[str, nn.Module, T]]:
    """``(name, module, entry)`` for each module of ``root`` whose type (or a base class) is in
    ``registry``, skipping modules inside one already found. ``name`` is ``""`` for ``root``."""
    found: list[tuple[str, nn.Module, T]] = []
    for name, module in root.named_modules():
        if any(p == "" or name == p or name.startswith(p + ".") for p, _, _ in found):
            continue
        entry = next((registry[cls] for cls in type(module).__mro__ if cls in registry), None)
        if entry is not None:
            found.append((name, module, entry))
    return found


def tied_parameter_groups(module: nn.Module) -> list[list[str]]:
    """Names of parameters shared by several modules, one list per shared parameter."""
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]
