"""Questions about a module tree that tensor and pipeline parallelism both ask."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from torch import nn

__all__ = ["Matcher", "check_matcher", "outermost_registered", "tied_parameter_groups"]

T = TypeVar("T")

Matcher = type[nn.Module] | Callable[[nn.Module], bool]
"""What a registry entry applies to: an ``nn.Module`` subclass (and its subclasses), or a predicate
on module instances (for families known by name only, such as Hugging Face's, without importing them)."""


def check_matcher(name: str, matcher: object) -> None:
    """Raise ``TypeError`` unless ``matcher`` is an ``nn.Module`` subclass or a predicate."""
    if isinstance(matcher, type):
        if not issubclass(matcher, nn.Module):
            raise TypeError(f"{name} needs an nn.Module subclass or a predicate on modules, got {matcher!r}")
    elif not callable(matcher):
        raise TypeError(f"{name} needs an nn.Module subclass or a predicate on modules, got {matcher!r}")


def _entry(module: nn.Module, registry: Mapping[Matcher, T]) -> T | None:
    for cls in type(module).__mro__:
        if cls in registry:
            return registry[cls]
    return next((entry for key, entry in registry.items() if not isinstance(key, type) and key(module)), None)


def outermost_registered(root: nn.Module, registry: Mapping[Matcher, T]) -> list[tuple[str, nn.Module, T]]:
    """``(name, module, entry)`` for each module of ``root`` that a key of ``registry`` matches (its
    type or a base class, else a predicate), skipping modules inside one already found. ``name`` is
    ``""`` for ``root``."""
    found: list[tuple[str, nn.Module, T]] = []
    for name, module in root.named_modules():
        if any(p == "" or name == p or name.startswith(p + ".") for p, _, _ in found):
            continue
        entry = _entry(module, registry)
        if entry is not None:
            found.append((name, module, entry))
    return found


def tied_parameter_groups(module: nn.Module) -> list[list[str]]:
    """Names of parameters shared by several modules, one list per shared parameter."""
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]
