"""The public API loses no name without a deprecation, and every old path says where its name went.

``tests/public_api.json`` is the snapshot: each public module (no part of its dotted path starts with
``_``) -> its public names: its ``__all__``, else the names it defines at top level without a leading
underscore (imports are not definitions). It also holds the paths of earlier layouts that import with a
``DeprecationWarning`` until 0.3.0 (CHANGELOG.md lists them under Deprecated).

The snapshot is compared with the tree read statically (no imports); a snapshot name the tree no longer
defines must still be read from its module at run time (a re-export), and one that warns must name a
path that gives the same object.

When a test here fails:

- a name or module is gone: keep its old path working for a release with
  :func:`lightning_scale.core.deprecation.moved_names` (a name left a module) or
  :func:`~lightning_scale.core.deprecation.moved_modules` (a module is gone), and list it under
  Deprecated in CHANGELOG.md;
- names or modules were added: ``python tests/test_public_api.py --update`` rewrites the snapshot (it
  keeps every name that still imports, deprecated ones too); commit it with the change.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = Path(__file__).with_name("public_api.json")
PACKAGE = "lightning_scale"


def _defined_names(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                elements = target.elts if isinstance(target, ast.Tuple) else [target]
                names += [e.id for e in elements if isinstance(e, ast.Name)]
    return names


def _public_names(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            try:
                return sorted(set(ast.literal_eval(node.value)))
            except ValueError:
                raise ValueError(f"{path}: __all__ must be a literal list of strings") from None
    return sorted({n for n in _defined_names(tree) if not n.startswith("_")})


def public_api(root: Path, package: str = PACKAGE) -> dict[str, list[str]]:
    """Each public module of ``package`` under ``root`` -> its public names, read without importing it."""
    api = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not any(p.startswith("_") for p in parts):
            api[".".join(parts)] = _public_names(path)
    return api


def _read(module: str, name: str) -> tuple[Any, list[str]]:
    """``module.name`` at run time and the deprecation messages reading it gave (raises if it is gone)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if module in sys.modules and getattr(sys.modules[module], "__file__", None) is None:
            del sys.modules[module]  # a moved module's stand-in warns when imported: import it afresh
        value = getattr(importlib.import_module(module), name)
    return value, [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def missing_names(snapshot: Mapping[str, list[str]], root: Path, package: str = PACKAGE) -> list[str]:
    """Snapshot names the tree at ``root`` neither defines nor re-exports (``module.name``)."""
    current = public_api(root, package)
    missing = []
    for module, names in sorted(snapshot.items()):
        for name in sorted(set(names) - set(current.get(module, ()))):
            try:
                _read(module, name)
            except (ImportError, AttributeError):
                missing.append(f"{module}.{name}")
    return missing


def _lookup(path: str) -> Any:
    try:
        return importlib.import_module(path)
    except ImportError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


def deprecation_problems(snapshot: Mapping[str, list[str]], root: Path, package: str = PACKAGE) -> list[str]:
    """Each snapshot name kept by a deprecation whose warning names no path that gives the same object
    without a warning of its own. Names re-exported without a warning are not deprecated: not checked."""
    current = public_api(root, package)
    problems = []
    for module, names in sorted(snapshot.items()):
        for name in sorted(set(names) - set(current.get(module, ()))):
            try:
                value, messages = _read(module, name)
            except (ImportError, AttributeError):
                continue  # gone: test_no_public_name_is_gone_without_a_deprecation says so
            if not messages:
                continue
            paths = {p for m in messages for p in re.findall(rf"`({package}(?:\.\w+)+)`", m)}
            found = []
            for path in sorted(paths - {module, f"{module}.{name}"}):
                for candidate in (path, f"{path}.{name}"):
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        try:
                            new = _lookup(candidate)
                        except (ImportError, AttributeError):
                            continue
                    if new is value and not any(issubclass(w.category, DeprecationWarning) for w in caught):
                        found.append(candidate)
            if not found:
                problems.append(f"{module}.{name}: {messages}")
    return problems


def _snapshot() -> dict[str, list[str]]:
    return json.loads(SNAPSHOT.read_text())


def test_no_public_name_is_gone_without_a_deprecation() -> None:
    missing = missing_names(_snapshot(), ROOT)
    assert not missing, (
        f"{len(missing)} public names are gone: {missing}. Keep each old path working for a release "
        "(lightning_scale.core.deprecation: moved_names in the module, moved_modules in its package for a "
        "module that is gone) and list it under Deprecated in CHANGELOG.md; "
        "a name removed on purpose: `python tests/test_public_api.py --update` and say so under Removed."
    )


def test_new_public_names_are_in_the_snapshot() -> None:
    # Else a name added now could later disappear unnoticed.
    snapshot = _snapshot()
    new = sorted(f"{m}.{n}" for m, names in public_api(ROOT).items() for n in set(names) - set(snapshot.get(m, ())))
    assert not new, f"public names not in tests/public_api.json: {new}; run `python tests/test_public_api.py --update`"


def test_every_deprecated_path_names_its_new_path_and_gives_the_same_object() -> None:
    problems = deprecation_problems(_snapshot(), ROOT)
    assert not problems, f"deprecated paths whose warning does not lead to the same object: {problems}"


def test_old_paths_warn_with_the_new_path() -> None:
    # The deprecations users meet most, spelled out (the tests above check every one through the snapshot).
    from lightning_scale.core.parallel.data_parallel import bf16_all_reduce_hook
    from lightning_scale.core.pipeline.spec import PipelineSpec, labelled_tokens

    with pytest.warns(DeprecationWarning, match=r"`lightning_scale\.core\.pipeline\.spec\.PipelineSpec`.*0\.3\.0"):
        from lightning_scale.core.pipeline import PipelineSpec as old_spec
    with pytest.warns(DeprecationWarning, match=r"`lightning_scale\.core\.pipeline\.spec\.labelled_tokens`"):
        from lightning_scale.core.pipeline import labelled_tokens as old_tokens
    assert old_spec is PipelineSpec and old_tokens is labelled_tokens
    sys.modules.pop("lightning_scale.core.data_parallel", None)  # imported by an earlier test: import afresh
    split = (
        r"`lightning_scale\.core\.data_parallel` was split into `lightning_scale\.core\.parallel\.data_parallel` and"
    )
    with pytest.warns(DeprecationWarning, match=split):
        data_parallel = importlib.import_module("lightning_scale.core.data_parallel")
    with pytest.warns(DeprecationWarning, match=r"moved to `lightning_scale\.core\.parallel\.data_parallel\.bf16_all"):
        assert data_parallel.bf16_compress_hook is bf16_all_reduce_hook
    with pytest.raises(AttributeError, match="module 'lightning_scale.core.pipeline' has no attribute 'nothing'"):
        getattr(importlib.import_module("lightning_scale.core.pipeline"), "nothing")


def _fake_package(root: Path, name: str) -> None:
    """``name``: ``a`` exports x, y (z moved to ``b``, kept by moved_names), ``b`` exports z;
    the former module ``old`` is ``a`` now (moved_modules)."""
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(
        "from lightning_scale.core.deprecation import moved_modules\n\n"
        f"moved_modules(__name__, {{'old': ('{name}.a',)}})\n"
    )
    (root / name / "a.py").write_text(
        "from lightning_scale.core.deprecation import moved_names\n\n"
        "__all__ = ['x', 'y']\nx = 1\ny = 2\n"
        f"__getattr__ = moved_names(__name__, {{'z': '{name}.b.z'}})\n"
    )
    (root / name / "b.py").write_text("z = object()\n_private = 1\n")


def test_the_checks_see_a_name_that_is_gone_and_accept_a_deprecated_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Guard against checks that can never fail: a fake package, so that names can go.
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_package(tmp_path, "fake_api_pkg")
    assert public_api(tmp_path, "fake_api_pkg") == {
        "fake_api_pkg": [],
        "fake_api_pkg.a": ["x", "y"],
        "fake_api_pkg.b": ["z"],
    }
    snapshot = {"fake_api_pkg.a": ["x", "y", "z"], "fake_api_pkg.b": ["z"], "fake_api_pkg.old": ["x", "y"]}
    assert missing_names(snapshot, tmp_path, "fake_api_pkg") == []  # z and old kept by deprecations
    assert deprecation_problems(snapshot, tmp_path, "fake_api_pkg") == []
    # y leaves a: gone from a and from the module `old` reads from.
    (tmp_path / "fake_api_pkg" / "a.py").write_text(
        (tmp_path / "fake_api_pkg" / "a.py").read_text().replace("'x', 'y'", "'x'").replace("y = 2\n", "")
    )
    for module in [m for m in sys.modules if m.startswith("fake_api_pkg")]:
        monkeypatch.delitem(sys.modules, module)
    assert missing_names(snapshot, tmp_path, "fake_api_pkg") == ["fake_api_pkg.a.y", "fake_api_pkg.old.y"]


def test_a_warning_that_names_another_object_is_a_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Guard against a check that can never fail: two hand-written re-exports of v (= w), one whose warning
    # names w, one whose warning names z, another object.
    monkeypatch.syspath_prepend(str(tmp_path))
    for package, named in (("fake_api_right", "w"), ("fake_api_wrong", "z")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(
            "import warnings\n\n__all__ = ['z']\nz = object()\nw = object()\n\n\n"
            "def __getattr__(name):\n"
            "    if name != 'v':\n"
            "        raise AttributeError(name)\n"
            f"    warnings.warn('`{package}.v` moved to `{package}.{named}`', DeprecationWarning, stacklevel=2)\n"
            "    return w\n"
        )
    assert deprecation_problems({"fake_api_right": ["v", "z"]}, tmp_path, "fake_api_right") == []
    (problem,) = deprecation_problems({"fake_api_wrong": ["v", "z"]}, tmp_path, "fake_api_wrong")
    assert problem.startswith("fake_api_wrong.v: ['`fake_api_wrong.v` moved to `fake_api_wrong.z`']")


def test_moved_modules_refuses_a_bad_declaration() -> None:
    from lightning_scale.core.deprecation import moved_modules

    with pytest.raises(TypeError, match=r"give a non-empty tuple of module paths"):
        moved_modules("fake_api_bad", {"old": "fake_api_bad.new"})
    with pytest.raises(ValueError, match=r"renamed names of \['other'\]"):
        moved_modules("fake_api_bad", {"old": ("fake_api_bad.new",)}, renamed={"other": {"a": "fake_api_bad.b"}})


def test_the_version_is_the_same_in_the_package_the_project_and_the_changelog() -> None:
    import lightning_scale

    project = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    assert lightning_scale.__version__ == project
    assert f"## [{project}]" in (ROOT / "CHANGELOG.md").read_text(), f"CHANGELOG.md has no section for {project}"


def _update() -> None:
    """The tree's public API, plus every snapshot name that still imports (deprecated ones)."""
    api = {m: set(names) for m, names in public_api(ROOT).items()}
    old = _snapshot() if SNAPSHOT.exists() else {}
    for module, names in old.items():
        for name in set(names) - api.get(module, set()):
            try:
                _read(module, name)
            except (ImportError, AttributeError):
                print(f"dropped {module}.{name}: it no longer imports")
                continue
            api.setdefault(module, set()).add(name)
    SNAPSHOT.write_text(json.dumps({m: sorted(n) for m, n in sorted(api.items())}, indent=1) + "\n")
    print(f"wrote {SNAPSHOT} ({sum(map(len, api.values()))} names in {len(api)} modules)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(f"usage: python {sys.argv[0]} --update  (rewrites {SNAPSHOT.name} from the tree)")
    sys.path.insert(0, str(ROOT))
    _update()
