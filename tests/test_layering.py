"""Imports only go downward (DESIGN.md "Layers")."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

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
        if not (name.split(".")[0] in allowed_roots or name == "lightning_scale.core" or name.startswith("lightning_scale.core."))
    ]
    assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}; core may import torch and the stdlib only"


CORE_MAY_IMPORT = {
    "checks": set(),
    "lr_schedule": set(),
    "parallel": {"checks"},
    "checkpoint": {"checks", "parallel"},
    "pipeline": {"checks", "parallel"},
    "precision": {"checks", "parallel"},
    "telemetry": {"checks", "parallel"},
}
"""What each part of ``core`` may import from the rest of it (its own modules aside); the docstring of
``lightning_scale/core/__init__.py`` says the same."""


def _core_part(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["lightning_scale", "core"] else None


def test_core_is_only_made_of_the_declared_parts() -> None:
    found = {p.stem if p.parent == PKG / "core" else p.relative_to(PKG / "core").parts[0] for p in _files("core")}
    assert found - {"__init__"} == set(CORE_MAY_IMPORT), "a new part of core: declare what it may import"


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


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    # Guard against a checker that can never fail.
    fake = PKG / "core" / "lr_schedule.py"
    assert "math" in _imports(fake)
    bad_file = tmp_path / "bad.py"
    bad_file.write_text("import lightning.pytorch as pl\nfrom omegaconf import OmegaConf\n")
    names = [n for n in ast.walk(ast.parse(bad_file.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert len(names) == 2


def test_the_hugging_face_integration_does_not_import_transformers() -> None:
    # `import lightning_scale` registers it; it must stay light and work without the extra.
    bad = [n for p in (PKG / "integrations").rglob("*.py") for n in _imports(p) if n.split(".")[0] == "transformers"]
    assert not bad, bad


def test_the_direction_check_sees_an_upward_import() -> None:
    # Guard against a direction check that can never fail: checkpoint importing telemetry is upward-sideways.
    assert _core_part("lightning_scale.core.telemetry.flops") == "telemetry"
    assert "telemetry" not in CORE_MAY_IMPORT["checkpoint"] and _core_part("lightning_scale.cli.train") is None
