"""``import lightning_scale`` registers the strategies with Lightning without importing Lightning itself.

Lightning takes seconds to import (it imports torchmetrics, which imports transformers when that is
installed), and ``lightning-scale-plan`` or ``lightning-scale-ckpt`` need none of it. So the names
``"hybrid"``, ``"pipeline"`` and ``"tensor_parallel"`` are registered (by importing
:mod:`lightning_scale.strategies`) as soon as both are imported, whichever comes first:

- Lightning already imported: now;
- otherwise a finder at the head of ``sys.meta_path`` waits for the ``lightning`` package to finish
  importing, and for every import of this package's modules then in progress on the thread to finish
  (one of them, half run, may be one the strategies import names from), registers and removes itself.

The finder only wraps the loaders of ``lightning`` and of this package's modules, to see their imports
end; everything else about them (``__spec__``, resources, source) is the file finder's. Nothing of
Lightning is imported here.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import Any

__all__ = ["register_strategies_with_lightning"]

_LIGHTNING = "lightning"
_PACKAGE = __name__.partition(".")[0]


def _register() -> None:
    import lightning_scale.strategies  # noqa: F401  (registers the names with Lightning's StrategyRegistry)


class _EndOfImport:
    """A loader that runs the file finder's and tells the finder when the module's import ends."""

    def __init__(self, loader: Any, finder: _RegisterWhenLightningLoads) -> None:
        self._loader, self._finder = loader, finder

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, is_package, ...
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._finder.depth.value = self._finder.imports_in_progress() + 1
        try:
            self._loader.exec_module(module)
        finally:
            self._finder.depth.value -= 1
        self._finder.register_if_ready()


class _RegisterWhenLightningLoads:
    def __init__(self) -> None:
        self.depth = threading.local()  # imports of the package's modules (and Lightning's) in progress

    def imports_in_progress(self) -> int:
        return getattr(self.depth, "value", 0)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _LIGHTNING and not fullname.startswith(f"{_PACKAGE}."):
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        else:
            return None
        if spec.has_location and hasattr(spec.loader, "exec_module"):  # a file, not a moved module's stand-in
            spec.loader = _EndOfImport(spec.loader, self)
        return spec

    def register_if_ready(self) -> None:
        # Lightning never imports this package, so once in sys.modules it is whole unless being imported here.
        if self.imports_in_progress() or _LIGHTNING not in sys.modules or self not in sys.meta_path:
            return
        sys.meta_path.remove(self)
        _register()


def register_strategies_with_lightning() -> None:
    """Register the strategies now if Lightning is imported, else once it is (see the module's docstring)."""
    if _LIGHTNING in sys.modules:
        _register()
    elif not any(isinstance(f, _RegisterWhenLightningLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenLightningLoads())
