"""What the package declares about its environment is what it needs, and what the suite runs under holds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from lightning_scale._torch_version import MIN_TORCH, check_torch_version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_declared_torch_floor_is_the_one_the_package_checks() -> None:
    (torch_req,) = [r for r in PYPROJECT["project"]["dependencies"] if re.match(r"torch\b", r)]
    # The ceiling (",<2.14") is the canaries' (tests/test_compat.py).
    floor = re.fullmatch(r"torch>=(\d+)\.(\d+)(,<\d+\.\d+)?", torch_req)
    assert floor, torch_req
    assert (int(floor[1]), int(floor[2])) == MIN_TORCH
    check_torch_version(str(torch.__version__))  # the installed torch meets it


@pytest.mark.parametrize("version", ["2.6.0", "2.12.1+cu126", "1.13.1", "nightly"])
def test_an_older_torch_is_refused_at_import_with_the_fix(version: str) -> None:
    with pytest.raises(
        ImportError, match=rf"lightning-scale needs torch>=2\.13, but torch {re.escape(version)} is installed"
    ):
        check_torch_version(version)


def _timeouts(path: Path) -> list[tuple[int, float]]:
    """(line, seconds) of every ``timeout=<number>`` keyword argument in a test file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if (
                    kw.arg == "timeout"
                    and isinstance(kw.value, ast.Constant)
                    and isinstance(kw.value.value, (int, float))
                ):
                    found.append((node.lineno, float(kw.value.value)))
    return found


def test_every_harness_timeout_fires_before_pytest_kills_the_test() -> None:
    # The harness prints every rank's stack when it times out; pytest-timeout killing the test first
    # would lose them. Leave a minute for the stack dump and the process teardown.
    limit = float(PYPROJECT["tool"]["pytest"]["ini_options"]["timeout"])
    files = sorted((ROOT / "tests").rglob("*.py"))
    timeouts = {f"{p.relative_to(ROOT)}:{line}": t for p in files for line, t in _timeouts(p)}
    assert len(timeouts) > 20  # the scan sees the suite's timeouts
    too_long = {where: t for where, t in timeouts.items() if t > limit - 60}
    assert not too_long, f"pytest's timeout is {limit:.0f} s; these reach within a minute of it: {too_long}"
