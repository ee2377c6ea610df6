"""Fixtures every test gets: its own working directory, a restored environment, no process group
left behind, a shared cache of prepared data, and a check that the checkout gains no files; and
``world_of_one``, a process group of this process alone for unit tests of the distributed mechanisms."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _longest_modules_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_LONGEST = (
    "test_sweep.py",
    "test_cli.py",
    "test_checkpoint_faults.py",
    "test_examples.py",
    "test_deferred_init.py",
    "test_benchmarks.py",
    "test_planner.py",
    "test_conf.py",
)
"""The modules that took longest on 2 cores (2026-12-03: 300, 234, 110, 108, 95, 90 and 73 s; test_planner.py
77 s with its multi-process memory checks), longest first."""


def _longest_modules_first(items: list[pytest.Item]) -> None:
    """The longest modules first (:data:`_LONGEST`, then by their number of ``slow`` tests), each
    module's tests in their own order.

    The suite runs on two pytest-xdist workers, one module at a time each (``--dist loadfile``, so a
    module's fixtures run once): started first, the long multi-process modules overlap each other
    and the short ones fill the gaps, instead of one long module running alone at the end. The order
    is the same in every worker, as xdist requires."""

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    slow: dict[str, int] = {}
    for item in items:
        slow[module(item)] = slow.get(module(item), 0) + ("slow" in item.keywords)
    position = {name: i for i, name in enumerate(dict.fromkeys(module(i) for i in items))}
    rank = {f"tests/{name}": i for i, name in enumerate(_LONGEST)}
    items.sort(key=lambda i: (rank.get(module(i), len(rank)), -slow[module(i)], position[module(i)]))


def _untracked(root: Path) -> set[str]:
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=root, capture_output=True, text=True
    )
    return {line[3:] for line in out.stdout.splitlines() if line.startswith("??")} if out.returncode == 0 else set()


@pytest.fixture(scope="session", autouse=True)
def _checkout_stays_clean() -> Iterator[None]:
    """Tests write under their tmp_path only; new untracked files in the checkout fail the session."""
    before = _untracked(ROOT)
    yield
    added = sorted(p for p in _untracked(ROOT) - before if "__pycache__" not in p)
    if added:
        pytest.fail(f"tests left files in the checkout: {added[:20]}", pytrace=False)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache of prepared data for the whole session (the bundled corpus is prepared once)."""
    return tmp_path_factory.mktemp("lightning_scale_cache")


# What Lightning's `_init_dist_connection` writes into os.environ for the process group it creates.
# The planner's calibrations (lightning_scale.core.planner.calibration): never the user's ~/.cache one, so a
# calibration made on this machine changes no test; one file per test process, empty at the start.
os.environ["LIGHTNING_SCALE_CALIBRATION"] = os.path.join(tempfile.mkdtemp(prefix="ls-calibration-"), "calibration.json")

_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK")


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, data_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # A module- or session-scoped fixture that trained in this process (set up before this fixture)
    # may have left its process group and its rendezvous variables behind: a CLI run started by a
    # later test would inherit MASTER_PORT and find the port still held by this process.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in _RENDEZVOUS:
        os.environ.pop(key, None)
    saved_env = dict(os.environ)
    monkeypatch.chdir(tmp_path)
    os.environ["LIGHTNING_SCALE_CACHE"] = str(data_cache)
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_DIR"] = str(tmp_path)
    os.environ["WANDB_SILENT"] = "true"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_env)


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[DeviceMesh]:
    """A gloo process group of this process alone and its ``(dp, pp, tp) = (1, 1, 1)`` mesh: enough for
    a pipeline of one rank (one stage, or several on it), DTensors and FSDP2, with no process spawned."""
    store = dist.FileStore(str(tmp_path / "world_of_one.store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
