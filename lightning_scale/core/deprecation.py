"""Old import paths that keep working, with a warning, for one minor release after a name or a module moved.

Two mechanisms, one message (:func:`moved_message`): a ``DeprecationWarning`` naming the old path, the new
one and the release that drops the old one (:data:`REMOVED_IN`).

- A name left a module that still exists: that module's PEP 562 ``__getattr__`` is :func:`moved_names`::

      __getattr__ = moved_names(__name__, {"PipelineSpec": "lightning_scale.core.pipeline.spec.PipelineSpec"})

- A module is gone: its parent package declares it with :func:`moved_modules`::

      moved_modules(__name__, {"checksums": ("lightning_scale.core.checkpoint.checksums",)})

  ``import lightning_scale.core.checksums`` then gives a stand-in module (served by a finder at the end of
  ``sys.meta_path``, so it never shadows a real module) that warns once when imported and reads each name
  from the first of its new modules that exports it; a name that was renamed on the way is given its
  full new path in ``renamed``. Pickles that name a class at its old path load through the same stand-in.

``tests/test_public_api.py`` checks every old path against the public-API snapshot. A leaf of ``core``:
the standard library only, and every part of ``core`` may import it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

__all__ = ["REMOVED_IN", "moved_message", "moved_modules", "moved_names"]

REMOVED_IN = "0.3.0"
"""The release that drops the old paths declared here."""


def moved_message(old: str, new: str | Sequence[str]) -> str:
    """The warning for ``old`` (a dotted path), now at ``new`` (one path, or the modules it was split into)."""
    paths = [f"`{n}`" for n in ([new] if isinstance(new, str) else new)]
    where = f"moved to {paths[0]}" if len(paths) == 1 else f"was split into {', '.join(paths[:-1])} and {paths[-1]}"
    return f"`{old}` {where}; import from there (the old path goes in lightning-scale {REMOVED_IN})."


def _resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def moved_names(module: str, moves: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for names that left ``module``: ``moves`` maps each old name to
    its new full path (``"package.module.Name"``); reading one warns and returns the object itself."""
    moves = dict(moves)

    def __getattr__(name: str) -> Any:
        new = moves.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(moved_message(f"{module}.{name}", new), DeprecationWarning, stacklevel=2)
        return _resolve(new)

    return __getattr__


def _exported(module: ModuleType) -> Iterable[str]:
    names = getattr(module, "__all__", None)
    return names if names is not None else [n for n in vars(module) if not n.startswith("_")]


class _MovedModule:
    """What a module that is gone became: the modules its names went to, in order, and renamed names."""

    def __init__(self, name: str, to: Sequence[str], renamed: Mapping[str, str]) -> None:
        self.name, self.to, self.renamed = name, tuple(to), dict(renamed)

    def create_module(self, spec: Any) -> None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        moved = self
        module.__doc__ = f"Deprecated: {moved_message(self.name, self.to)}"

        def __getattr__(name: str) -> Any:
            if name in moved.renamed:
                warnings.warn(
                    moved_message(f"{moved.name}.{name}", moved.renamed[name]), DeprecationWarning, stacklevel=2
                )
                return _resolve(moved.renamed[name])
            if name == "__all__":
                return sorted({*moved.renamed, *(n for m in moved.to for n in _exported(importlib.import_module(m)))})
            if not name.startswith("_"):
                for new in moved.to:
                    target = importlib.import_module(new)
                    if name in _exported(target):
                        return getattr(target, name)
            raise AttributeError(f"module {moved.name!r} has no attribute {name!r} (it moved to {', '.join(moved.to)})")

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        module.__dir__ = lambda: sorted({*vars(module), *__getattr__("__all__")})  # type: ignore[method-assign]
        # stacklevel 2 is the import statement: warnings skips the import system's own frames.
        warnings.warn(moved_message(self.name, self.to), DeprecationWarning, stacklevel=2)


class _MovedModuleFinder:
    """Finds the modules declared gone (the last finder asked: a module that exists is found first)."""

    def __init__(self) -> None:
        self.moved: dict[str, _MovedModule] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        moved = self.moved.get(fullname)
        return None if moved is None else importlib.util.spec_from_loader(fullname, moved)


_FINDER = _MovedModuleFinder()


def moved_modules(
    package: str, modules: Mapping[str, Sequence[str]], renamed: Mapping[str, Mapping[str, str]] | None = None
) -> None:
    """Keep ``package.<old>`` importable for each ``old`` in ``modules``, which maps it to the modules its
    names went to (searched in order); ``renamed[old]`` maps an old name to its new full path. Call it in
    ``package``'s ``__init__`` (a package is always imported before its submodules)."""
    renamed = renamed or {}
    unknown = set(renamed) - set(modules)
    if unknown:
        raise ValueError(f"renamed names of {sorted(unknown)}, which are not in the moved modules {sorted(modules)}")
    for old, to in modules.items():
        if isinstance(to, str) or not to:
            raise TypeError(f"{package}.{old} moved to {to!r}: give a non-empty tuple of module paths")
        name = f"{package}.{old}"
        _FINDER.moved[name] = _MovedModule(name, to, renamed.get(old, {}))
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
