"""No private torch or Lightning API is used outside the compat modules.

``lightning_scale/core/compat.py`` and ``lightning_scale/core/compat_c10d.py`` (torch's: c10d's for the hang
watchdog in the second) and ``lightning_scale/_lightning_compat.py`` (Lightning's) hold every private API the package uses, each behind a shim with a canary in ``tests/test_compat.py``.
This scans the package's source for private uses anywhere else (imports of private names and modules,
``x._name`` and ``getattr(x, "_name")`` on library objects, ``self._name`` inherited from a library
class), so that a new one has to get a shim and a canary to pass.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import textwrap
from functools import cache
from pathlib import Path

from lightning_scale import _lightning_compat as lc
from lightning_scale.core import compat as tc
from lightning_scale.core import compat_c10d as c10d

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "lightning_scale"
SHIMS = {**tc.SHIMS, **c10d.SHIMS, **lc.SHIMS}

LIBRARIES = {
    "torch",
    "lightning",
    "lightning_fabric",
    "lightning_utilities",
    "pytorch_lightning",
    "torchmetrics",
    "hydra",
    "omegaconf",
    "fsspec",
    "transformers",
    "wandb",
    "deepspeed",
    "submitit",
}
COMPAT_FILES = {PKG / "core" / "compat.py", PKG / "core" / "compat_c10d.py", PKG / "_lightning_compat.py"}

OWN_MARKERS = {"_timed", "_residual_output"}
"""Private attributes the package sets on objects it does not own (a wrapped method, a layer) and reads back."""


@cache
def _own_names() -> frozenset[str]:
    """``_names`` the package defines: functions, classes, module and class attributes, ``self._x``."""
    names = set(OWN_MARKERS)
    for path in _package_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if ast.unparse(node.value) in ("self", "cls") or "lightning_scale" in node.attr:
                    names.add(node.attr)
    return frozenset(n for n in names if n.startswith("_"))


@cache
def _known_private() -> frozenset[str]:
    """The attribute names of every registered target: private, whoever else uses the name."""
    names = (target.rpartition(".")[2] for shim in SHIMS.values() for target in shim.targets)
    return frozenset(name for name in names if name.startswith("_"))


def _package_files() -> list[Path]:
    return sorted([*PKG.rglob("*.py"), *(ROOT / "hydra_plugins").rglob("*.py")])


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(source: str, own: frozenset[str], known: frozenset[str]) -> list[tuple[int, str, str]]:
    """``(line, name, what)`` for each private library API ``source`` uses: imports of private names or
    modules of :data:`LIBRARIES`; ``x._name`` (``x`` not ``self``/``cls``, nor a standard-library module)
    where ``_name`` is a registered target's or not one the package defines; the same through
    ``getattr``/``setattr``/``hasattr``/``delattr``; and string constants naming a registered target."""
    tree = ast.parse(source)
    stdlib = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name.split(".")[0] in sys.stdlib_module_names
    }
    found = []

    def attribute(node: ast.AST, base: ast.AST, name: str, what: str) -> None:
        if not _is_private(name) or ast.unparse(base) in ("self", "cls", "super()") or ast.unparse(base) in stdlib:
            return
        if name in known or name not in own:
            found.append((node.lineno, name, what))

    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] in LIBRARIES
        ):
            private_module = any(_is_private(part) for part in node.module.split("."))
            for alias in node.names:
                if private_module or _is_private(alias.name):
                    found.append((node.lineno, alias.name, f"from {node.module} import {alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in LIBRARIES and any(_is_private(p) for p in parts):
                    found.append((node.lineno, alias.name, f"import {alias.name}"))
        elif isinstance(node, ast.Attribute):
            attribute(node, node.value, node.attr, f"{ast.unparse(node)[:60]}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            attribute(node, node.args[0], node.args[1].value, f"{node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
            found.append((node.lineno, node.value, f"the string {node.value!r}"))
    return found


def _inherited_private_uses() -> list[tuple[Path, int, str, str]]:
    """``self._name`` uses and ``def _name`` overrides, in the package's classes (their own mixins included),
    of private members of the library classes they derive from. An override of a registered private hook
    is allowed: its canary guards it."""
    known = _known_private()
    found = []
    library_sources: dict[type, str] = {}
    for path in _package_files():
        if path in COMPAT_FILES or path.name == "__init__.py" or "hydra_plugins" in path.parts:
            continue
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for cls in [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__]:
            bases = [b for b in cls.__mro__ if b.__module__.split(".")[0] in LIBRARIES]
            if not bases:
                continue
            for own in [b for b in cls.__mro__ if b.__module__.startswith("lightning_scale.")]:
                own_file = Path(inspect.getsourcefile(own) or "")
                lines, start = inspect.getsourcelines(own)
                for node in ast.walk(ast.parse(textwrap.dedent("".join(lines)))):
                    if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("self", "cls"):
                        name, what = node.attr, f"self.{node.attr}"
                    elif isinstance(node, ast.FunctionDef) and node.name not in known:
                        name, what = node.name, f"def {node.name} (override)"
                    else:
                        continue
                    if not _is_private(name):
                        continue
                    for base in bases:
                        if base not in library_sources:
                            try:
                                library_sources[base] = inspect.getsource(base)
                            except (OSError, TypeError):
                                library_sources[base] = ""
                        if name in vars(base) or re.search(rf"self\.{name}\b", library_sources[base]):
                            found.append((own_file, start + node.lineno - 1, name, f"{what}, of {base.__qualname__}"))
                            break
    return sorted(set(found))


def _all_private_uses() -> list[tuple[Path, int, str, str]]:
    own, known = _own_names(), _known_private()
    found = [
        (path, line, name, what)
        for path in _package_files()
        if path not in COMPAT_FILES
        for line, name, what in private_uses(path.read_text(), own, known)
    ]
    return sorted(set(found + _inherited_private_uses()))


def test_no_private_api_outside_the_compat_modules() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line}: {what}" for p, line, _, what in _all_private_uses()]
    assert not bad, (
        "private torch/Lightning APIs used outside lightning_scale/core/compat.py, core/compat_c10d.py and "
        "lightning_scale/_lightning_compat.py; "
        "add a shim (with a canary in tests/test_compat.py) or use a public API:\n" + "\n".join(bad)
    )


def test_the_scan_sees_a_private_use() -> None:
    # Guard against a scan that can never fail.
    source = (
        "import os\n"
        "from torch.distributed.pipelining.schedules import _ComputationType\n"
        "import torch.distributed._tools\n"
        "from lightning.pytorch.core.saving import _load_state\n"
        "x = trainer._checkpoint_connector\n"
        "y = getattr(loop, '_data_source', None)\n"
        "z = model._some_new_private\n"
        "os._exit(0)\n"
        "self._mine = 1\n"
        "NAME = '_broadcast_sigterm_tensor'\n"
    )
    found = {name for _, name, _ in private_uses(source, _own_names(), _known_private())}
    assert found == {
        "_ComputationType",
        "torch.distributed._tools",
        "_load_state",
        "_checkpoint_connector",
        "_data_source",
        "_some_new_private",
        "_broadcast_sigterm_tensor",
    }
