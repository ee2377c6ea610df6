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
    fake = PKG / "core" / "schedules.py"
    assert "math" in _imports(fake)
    bad_file = tmp_path / "bad.py"
    bad_file.write_text("import lightning.pytorch as pl\nfrom omegaconf import OmegaConf\n")
    names = [n for n in ast.walk(ast.parse(bad_file.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert len(names) == 2


def test_the_hugging_face_integration_does_not_import_transformers() -> None:
    # `import lightning_scale` registers it; it must stay light and work without the extra.
    bad = [n for p in (PKG / "integrations").rglob("*.py") for n in _imports(p) if n.split(".")[0] == "transformers"]
    assert not bad, bad
