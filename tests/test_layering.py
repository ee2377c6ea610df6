"""Imports only go downward (DESIGN.md "Layers")."""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

PKG = Path(__file__).resolve().parents[1] / "lightning_scale"


def _imports(path: Path) -> list[str]:
    """Absolute module names imported by ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names.append(".".join(base + ([node.module] if node.module else [])))
            else:
                names.append(node.module or "")
    return names


def _files(sub: str) -> list[Path]:
    files = sorted((PKG / sub).rglob("*.py"))
    assert files, f"no python files under {sub}"
    return files


@pytest.mark.parametrize("path", _files("core"), ids=lambda p: p.name)
def test_core_imports_only_torch_and_the_standard_library(path: Path) -> None:
    allowed_roots = set(sys.stdlib_module_names) | {"torch", "__future__"}
    bad = [
        name
        for name in _imports(path)
        if not (
            name.split(".")[0] in allowed_roots
            or name == "lightning_scale.core"
            or name.startswith("lightning_scale.core.")
        )
    ]
    assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}; core may import torch and the stdlib only"


CORE_MAY_IMPORT = {
    "compat": set(),
    "deprecation": set(),
    "compat_c10d": {"compat"},
    "checks": {"compat"},
    "lr_schedule": {"compat"},
    "parallel": {"compat", "checks"},
    "checkpoint": {"compat", "checks", "parallel", "deprecation"},
    "pipeline": {"compat", "checks", "parallel", "deprecation"},
    "precision": {"compat", "checks", "parallel"},
    "telemetry": {"compat", "checks", "parallel"},
    "planner": {"compat", "checks", "parallel", "pipeline", "telemetry"},
    "resilience": {"compat", "compat_c10d", "checks"},
}
"""What each part of ``core`` may import from the rest of it (its own modules aside); the docstring of
``lightning_scale/core/__init__.py`` says the same. ``compat`` (torch's private APIs, one shim each) is a
leaf every part may import; ``deprecation`` (old import paths kept working) is a leaf too, declared by the
parts that keep an old path."""


def _core_part(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["lightning_scale", "core"] else None


def test_core_is_only_made_of_the_declared_parts() -> None:
    found = {p.stem if p.parent == PKG / "core" else p.relative_to(PKG / "core").parts[0] for p in _files("core")}
    assert found - {"__init__"} == set(CORE_MAY_IMPORT), "a new part of core: declare what it may import"
    # compat is the leaf below every other part: it imports nothing of core, and every part may import it.
    # deprecation is a leaf too (the standard library only), declared by the parts that keep an old path.
    assert CORE_MAY_IMPORT["compat"] == CORE_MAY_IMPORT["deprecation"] == set()
    assert all(
        "compat" in allowed for part, allowed in CORE_MAY_IMPORT.items() if part not in ("compat", "deprecation")
    )


@pytest.mark.parametrize("path", _files("core"), ids=lambda p: str(p.relative_to(PKG / "core")))
def test_core_parts_import_only_downward(path: Path) -> None:
    if path == PKG / "core" / "__init__.py":
        return
    own = _core_part(".".join(path.relative_to(PKG.parent).with_suffix("").parts))
    allowed = CORE_MAY_IMPORT[own] | {own}
    bad = [n for n in _imports(path) if _core_part(n) is not None and _core_part(n) not in allowed]
    assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}; core.{own} may import only {sorted(allowed)}"


@pytest.mark.parametrize("sub", ["strategies", "plugins", "callbacks", "core", "models", "data", "integrations"])
def test_lower_layers_never_import_cli_or_conf(sub: str) -> None:
    for path in (PKG / sub).rglob("*.py"):
        bad = [n for n in _imports(path) if n.startswith(("lightning_scale.cli", "lightning_scale.conf", "hydra"))]
        assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}"


@pytest.mark.parametrize("sub", ["strategies", "plugins", "callbacks", "integrations"])
def test_adapters_never_import_the_reference_models(sub: str) -> None:
    for path in (PKG / sub).rglob("*.py"):
        bad = [n for n in _imports(path) if n.startswith("lightning_scale.models")]
        assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}: adapters must work for every model"


@pytest.mark.parametrize("path", _files("strategies"), ids=lambda p: str(p.relative_to(PKG / "strategies")))
def test_strategies_never_import_callbacks(path: Path) -> None:
    # A strategy does what it needs itself (its hang watchdog and preemption: strategies/hybrid/resilience.py, over
    # core.resilience) and adds no callback to a fit. Callbacks may import a strategy (to stand aside under it).
    bad = [n for n in _imports(path) if n == "lightning_scale.callbacks" or n.startswith("lightning_scale.callbacks.")]
    assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}; strategies may use plugins and core, not callbacks"


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    # Guard against a checker that can never fail.
    fake = PKG / "core" / "lr_schedule.py"
    assert "math" in _imports(fake)
    bad_file = tmp_path / "bad.py"
    bad_file.write_text("import lightning.pytorch as pl\nfrom omegaconf import OmegaConf\n")
    names = [n for n in ast.walk(ast.parse(bad_file.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert len(names) == 2


def test_the_hugging_face_integration_does_not_import_transformers() -> None:
    # The strategies register it (after `import lightning_scale`); it must stay light and work without the extra.
    bad = [n for p in (PKG / "integrations").rglob("*.py") for n in _imports(p) if n.split(".")[0] == "transformers"]
    assert not bad, bad


def test_the_direction_check_sees_an_upward_import() -> None:
    # Guard against a direction check that can never fail: checkpoint importing telemetry is upward-sideways.
    assert _core_part("lightning_scale.core.telemetry.flops") == "telemetry"
    assert "telemetry" not in CORE_MAY_IMPORT["checkpoint"] and _core_part("lightning_scale.cli.train") is None


@cache
def _module_graph(root: Path = PKG) -> dict[str, set[str]]:
    """Each module of the package at ``root`` -> the package's modules its import statements name, every
    statement counted (inside functions and ``if TYPE_CHECKING:`` too; relative ones resolved). ``from pkg
    import name`` names the module ``pkg.name`` when there is one, else ``pkg`` itself."""
    files: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        named: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                named.update(f"{source}.{a.name}" if f"{source}.{a.name}" in files else source for a in node.names)
        edges = set()
        for name in named:
            while name and name not in files:  # a name inside a module (or outside the package: dropped)
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(name)
        graph[module] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        work.append((node, iter(sorted(graph.get(node, ())))))

    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Any]] = []
        visit(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    visit(succ)
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_cycle_anywhere_in_the_package() -> None:
    # Imports inside functions count: a cycle they hide still ties its modules into one knot.
    cycles = _cycles(_module_graph())
    assert not cycles, f"import cycles (each a set of modules that import each other): {cycles}"


def test_the_cycle_check_finds_a_planted_cycle(tmp_path: Path) -> None:
    # Guard against a detector that can never fail: a -> b -> c -> a is one cycle; d -> a and e -> e are not.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}) == [["a", "b", "c"]]
    assert _cycles({"x": {"y"}, "y": {"z"}, "z": set(), "w": {"x", "z"}}) == []
    # The graph sees relative imports, imports inside functions and `from package import module`.
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import thing\n")
    (pkg / "a.py").write_text("import os\n\ndef f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from ..a import f\nimport pkg.sub.c\nthing = 1\n")
    (pkg / "sub" / "c.py").write_text("from pkg import sub\n")
    graph = _module_graph(pkg)
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.sub.b"},
        "pkg.sub": {"pkg.sub.b"},
        "pkg.sub.b": {"pkg.a", "pkg.sub.c"},
        "pkg.sub.c": {"pkg.sub"},
    }
    assert _cycles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.b", "pkg.sub.c"]]


CLI_MAY_IMPORT = {
    "environment": set(),
    "resume": set(),
    "job_config": {"environment", "resume"},
    "results": {"environment", "job_config"},
    "run": {"environment", "job_config", "results", "resume"},
    "sweep_dirs": {"environment", "job_config", "results"},
    "sweep_launch": {"environment", "job_config"},
    "sweep": {"environment", "job_config", "results", "resume", "run", "sweep_dirs", "sweep_launch"},
    "resolvers": {"environment", "sweep_dirs"},
    "train": {
        "environment",
        "job_config",
        "results",
        "resume",
        "run",
        "sweep_dirs",
        "sweep_launch",
        "sweep",
        "resolvers",
    },
    "report_plots": set(),
    "report_sync": {"report_plots"},
    "report": {"environment", "results", "report_plots", "report_sync"},
    "ckpt": set(),
    "prepare": set(),
    "plan_sizing": set(),
    "plan_calibrate": set(),
    "plan": {"plan_sizing", "plan_calibrate"},
    "study_state": {"results"},
    "study_report": {"results", "study_state"},
    "study_layouts": {"job_config", "plan_calibrate"},
    "study": {
        "environment",
        "job_config",
        "plan_calibrate",
        "resolvers",
        "results",
        "resume",
        "run",
        "study_layouts",
        "study_report",
        "study_state",
        "sweep_launch",
    },
}
"""What each module of ``cli`` may import from the rest of it: ``lightning-scale-train``'s one-way chain
environment <- job_config <- results <- run <- sweep <- train (the docstring of ``lightning_scale/cli/__init__.py``
says the same), and the other apps beside it."""


def _cli_module(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["lightning_scale", "cli"] else None


def test_cli_is_only_made_of_the_declared_modules() -> None:
    found = {p.stem for p in _files("cli")} - {"__init__"}
    assert found == set(CLI_MAY_IMPORT), "a new module in cli: declare what it may import"
    assert not _cycles({k: set(v) for k, v in CLI_MAY_IMPORT.items()}), "the declared chain itself has a cycle"


@pytest.mark.parametrize("own", sorted(CLI_MAY_IMPORT))
def test_cli_modules_import_only_down_their_chain(own: str) -> None:
    # Every import statement counts, `from lightning_scale.cli import sweep` and those inside functions too.
    named = {_cli_module(n) for n in _module_graph()[f"lightning_scale.cli.{own}"]} - {None}
    bad = sorted(named - CLI_MAY_IMPORT[own])
    assert not bad, f"cli.{own} imports cli.{bad}; it may import only {sorted(CLI_MAY_IMPORT[own])} from cli"


def test_the_chain_check_sees_an_upward_import() -> None:
    # Guard against a chain check that can never fail: the run importing the sweep goes back up the chain.
    assert _cli_module("lightning_scale.cli.sweep") == "sweep" and "sweep" not in CLI_MAY_IMPORT["run"]
    assert _cli_module("lightning_scale.core.checks") is None and _cli_module("lightning_scale.cli") is None
    assert "lightning_scale.cli.run" in _module_graph()["lightning_scale.cli.sweep"]


def test_no_module_grows_past_several_jobs() -> None:
    # About 500 formatted lines is a sign that a module holds more than one job, to split by what it does
    # (issue 39); past 700 it certainly does. Not a budget to pack lines into: ruff formats every module.
    long = {
        str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 700
    }
    assert not long, long


def _lightning_callback_bases(tree: ast.Module) -> set[str]:
    """How a file spells Lightning's ``Callback`` in a class's bases (``Callback``, ``pl.Callback``, an alias): by
    its imports, so that another library's ``Callback`` (Hydra's) is not taken for it."""
    spelled: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning":
            spelled |= {alias.asname or alias.name for alias in node.names if alias.name == "Callback"}
        elif isinstance(node, ast.Import):
            spelled |= {f"{a.asname or a.name}.Callback" for a in node.names if a.name.split(".")[0] == "lightning"}
    return spelled


def _callback_classes(files: list[Path], root: Path = PKG) -> dict[str, set[str]]:
    """File (relative to ``root``) -> the classes defined in it that derive from Lightning's ``Callback`` (as the
    file imports it), through any chain of the files' own classes (compared by their last dotted name)."""
    bases: dict[tuple[str, str], set[str]] = {}
    direct: set[tuple[str, str]] = set()
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        lightning_callback = _lightning_callback_bases(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                key = (str(path.relative_to(root)), node.name)
                bases[key] = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
                if {ast.unparse(b) for b in node.bases} & lightning_callback:
                    direct.add(key)
    callbacks = {name for _, name in direct}
    while True:
        found = callbacks | {name for (_, name), of in bases.items() if of & callbacks}
        if found == callbacks:
            break
        callbacks = found
    out: dict[str, set[str]] = {}
    for (file, name), of in bases.items():
        if (file, name) in direct or of & callbacks:
            out.setdefault(file, set()).add(name)
    return out


def test_callbacks_are_defined_in_callbacks_only() -> None:
    # Strategies, plugins and the data module own collaborators, not callbacks (issue 39): a callback elsewhere is
    # one added to the user's fit behind their back, paying Lightning's per-step dispatch. Those the command line
    # adds (its validation record and CSV history) are callbacks too, and live here.
    found = _callback_classes(sorted(PKG.rglob("*.py")))
    elsewhere = {f: names for f, names in found.items() if not f.startswith("callbacks/")}
    assert not elsewhere, f"Callback subclasses outside lightning_scale/callbacks/: {elsewhere}"
    assert {"HangWatchdog", "PreemptionCheckpoint", "ValidationRecord", "LoaderBatchProgress"} <= set().union(
        *found.values()
    )


def test_the_callback_check_sees_a_planted_callback(tmp_path: Path) -> None:
    # Guard against a check that can never fail: a callback through a chain of the package's own classes.
    (tmp_path / "a.py").write_text("from lightning.pytorch import Callback\nclass Base(Callback): ...\n")
    (tmp_path / "b.py").write_text("import a\nclass Mine(a.Base): ...\nclass Other: ...\n")
    # Hydra's Callback is not Lightning's; `import lightning.pytorch as pl` spells it pl.Callback.
    (tmp_path / "c.py").write_text("from hydra.experimental.callback import Callback\nclass Summary(Callback): ...\n")
    (tmp_path / "d.py").write_text("import lightning.pytorch as pl\nclass Probe(pl.Callback): ...\n")
    assert _callback_classes(sorted(tmp_path.glob("*.py")), tmp_path) == {
        "a.py": {"Base"},
        "b.py": {"Mine"},
        "d.py": {"Probe"},
    }
