"""The checkpoint directory format (``lightning_scale.core.checkpoint.format``): atomic commit, the
manifest, verification naming the broken file, ``latest`` falling back, retention. No process group."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import pytest

from lightning_scale.core.checkpoint.commit import commit, file_entries, staging_dir, write_manifest
from lightning_scale.core.checkpoint.format import (
    MANIFEST,
    CheckpointCorruptError,
    checkpoint_name,
    find_checkpoints,
    retained,
    verify,
)
from lightning_scale.core.checkpoint.latest import latest


def _save(root: Path, step: int, payload: bytes = b"weights", token: str = "t0", checksum: str = "crc32") -> Path:
    """What two processes would do: each writes and hashes its shard; one writes the manifest; commit."""
    final = root / checkpoint_name(step)
    staging = staging_dir(final, token)
    staging.mkdir(parents=True)
    entries = []
    for rank in range(2):
        shard = staging / f"__{rank}_0.distcp"
        shard.write_bytes(payload * (rank + 1))
        entries += file_entries(staging, [shard.name], checksum=checksum)
    (staging / ".metadata").write_bytes(b"meta")
    entries += file_entries(staging, [".metadata"], checksum=checksum)
    write_manifest(staging, entries, {"global_step": step, "layout": {"dp": 2, "tp": 1, "pp": 1}})
    return commit(staging, final)


def test_a_committed_checkpoint_verifies_and_lists_its_files(tmp_path: Path) -> None:
    path = _save(tmp_path, 7)
    assert path.name == "step-000007" and not list(tmp_path.glob(".*"))  # the staging directory is gone
    manifest = verify(path)
    assert manifest["global_step"] == 7 and manifest["layout"] == {"dp": 2, "tp": 1, "pp": 1}
    assert [f["path"] for f in manifest["files"]] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert manifest["files"][2]["bytes"] == len(b"weights") * 2


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda p: (p / "__1_0.distcp").write_bytes(b"weightsweightX"), r"__1_0.distcp does not match its crc32"),
        (
            lambda p: (p / "__0_0.distcp").write_bytes(b"wei"),
            r"__0_0.distcp has 3 bytes, the manifest says 7: truncated",
        ),
        (lambda p: (p / "__1_0.distcp").unlink(), r"__1_0.distcp is missing"),
        (lambda p: (p / MANIFEST).unlink(), r"manifest.json is missing: .* is not a \(complete\) checkpoint"),
        (lambda p: (p / MANIFEST).write_text("{not json"), r"manifest.json is not valid JSON"),
    ],
    ids=["flipped-byte", "truncated", "shard-deleted", "manifest-deleted", "manifest-garbled"],
)
def test_verify_names_the_broken_file(tmp_path: Path, damage, match: str) -> None:
    path = _save(tmp_path, 3)
    damage(path)
    with pytest.raises(CheckpointCorruptError, match=match):
        verify(path)


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
def test_manifest_entries_name_their_checksum_a_standard_one_any_tool_recomputes(tmp_path: Path, checksum: str) -> None:
    import hashlib
    import zlib

    path = _save(tmp_path, 5, payload=bytes(range(256)) * 9, checksum=checksum)
    entry = next(e for e in verify(path)["files"] if e["path"] == "__1_0.distcp")
    data = (path / "__1_0.distcp").read_bytes()
    expected = f"{zlib.crc32(data):08x}" if checksum == "crc32" else hashlib.sha256(data).hexdigest()
    assert set(entry) == {"path", "bytes", checksum} and entry[checksum] == expected
    _flip(path / "__1_0.distcp", 1000)
    with pytest.raises(CheckpointCorruptError, match=rf"__1_0.distcp does not match its {checksum}"):
        verify(path)


def test_a_version_1_manifest_still_verifies_and_a_newer_or_unhashed_one_is_refused(tmp_path: Path) -> None:
    assert json.loads((_save(tmp_path / "crc", 4) / MANIFEST).read_text())["format_version"] == 2
    path = _save(tmp_path, 4, checksum="sha256")
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format_version"] == 1  # SHA-256 only: what earlier releases wrote, and read
    assert verify(path)["global_step"] == 4
    (path / MANIFEST).write_text(json.dumps({**manifest, "format_version": 3}))
    with pytest.raises(CheckpointCorruptError, match=r"format_version=3; this lightning-scale reads versions \(1, 2\)"):
        verify(path)
    manifest["files"][0].pop("sha256")
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointCorruptError, match=r"lists '\.metadata' without a checksum \(one of \('crc32', 'sha256'\)\)"
    ):
        verify(path, checksums=False)
    with pytest.raises(
        ValueError, match=r"checksum='md5' is not a checksum algorithm lightning-scale writes: choose one of"
    ):
        file_entries(path, ["__0_0.distcp"], checksum="md5")


def test_a_manifest_cannot_point_outside_its_directory(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    (tmp_path / "secret").write_bytes(b"x")
    manifest = json.loads((path / MANIFEST).read_text())
    for bad in ("../secret", "/etc/passwd"):
        manifest["files"] = [{"path": bad, "bytes": 1, "sha256": "0"}]
        (path / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(CheckpointCorruptError, match="a path outside the checkpoint directory"):
            verify(path)


def test_latest_skips_broken_checkpoints_with_a_warning_that_names_them(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    assert latest([tmp_path]).path == newest
    (newest / "__0_0.distcp").write_bytes(b"WEIGHTS")  # same size, other bytes
    with pytest.warns(RuntimeWarning, match=r"Skipping the broken checkpoint .*step-000020.*__0_0.distcp"):
        assert latest([tmp_path]).path.name == "step-000010"
    # A crash before the manifest was written leaves a directory that is not a checkpoint at all.
    crashed = tmp_path / "step-000030"
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"partial")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest([tmp_path]).path.name == "step-000010"
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert re.search(r"Skipping .*step-000030, not a checkpoint: .*manifest.json is missing", messages[0])
    assert "step-000020" in messages[1]
    assert [c.step for c in find_checkpoints(tmp_path)] == [10, 20]
    assert latest([tmp_path / "nowhere"]) is None


def test_a_crash_before_commit_leaves_only_a_hidden_staging_directory(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    staging = staging_dir(tmp_path / checkpoint_name(2), "abc")
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"half")
    assert staging == tmp_path / ".step-000002.staging-abc"  # a hidden sibling, named for the checkpoint
    assert [c.step for c in find_checkpoints(tmp_path)] == [1]
    with pytest.raises(CheckpointCorruptError, match="has no manifest.json: write the manifest before committing"):
        commit(staging, tmp_path / checkpoint_name(2))


def test_committing_over_an_existing_name_replaces_it_whole(tmp_path: Path) -> None:
    first = _save(tmp_path, 5, payload=b"old")
    again = _save(tmp_path, 5, payload=b"new", token="t1")
    assert again == first and (again / "__0_0.distcp").read_bytes() == b"new"
    verify(again)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000005"]  # nothing left aside


def test_retention_keeps_the_newest_every_nth_and_the_protected(tmp_path: Path) -> None:
    for step in (100, 200, 300, 400, 500):
        _save(tmp_path, step)
    found = find_checkpoints(tmp_path)
    keep, delete = retained(found, keep_last=2, keep_every=200, protect=[tmp_path / "step-000100"])
    assert [c.step for c in keep] == [100, 200, 400, 500] and [c.step for c in delete] == [300]
    keep, delete = retained(found[:1], keep_last=1)
    assert [c.step for c in keep] == [100] and delete == []
    with pytest.raises(
        ValueError,
        match=r"keep_last=0 must be a positive integer \(1 or more\)\. The newest checkpoint is always kept\.",
    ):
        retained(found, keep_last=0)
    with pytest.raises(
        ValueError,
        match=r"keep_every=0 must be a positive integer \(1 or more\)\. Or None: keep only the newest keep_last\.",
    ):
        retained(found, keep_last=1, keep_every=0)


def test_bad_names_and_metadata_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"step=-1 must be 0 or more"):
        checkpoint_name(-1)
    with pytest.raises(ValueError, match=r"token='a/b' must be letters, digits"):
        staging_dir(tmp_path / "step-000001", "a/b")
    staging = tmp_path / "s"
    staging.mkdir()
    with pytest.raises(ValueError, match=r"Two processes listed the same checkpoint files: \['x'\]"):
        write_manifest(staging, [{"path": "x", "bytes": 1, "sha256": "0"}] * 2, {})
    with pytest.raises(TypeError):
        write_manifest(staging, [], {"not_json": object()})
    assert not (staging / MANIFEST).exists() and os.listdir(staging) == []


def _save_tp2(rank: int, world: int, root: str) -> list[str]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_scale.core.checkpoint.sharded import save_sharded

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.ones(3)}
    path = save_sharded(Path(root) / checkpoint_name(3), state, metadata={"global_step": 3}, token="tok")
    return sorted(p.name for p in path.iterdir())


def test_every_rank_writes_its_shard_and_one_process_loads_the_whole(tmp_path: Path) -> None:
    import torch
    from helpers.distributed import run_distributed

    from lightning_scale.core.checkpoint.sharded import load_sharded, save_sharded

    files = run_distributed(_save_tp2, 2, str(tmp_path), timeout=120)[0]
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST]
    manifest = verify(tmp_path / "step-000003")
    assert [f["path"] for f in manifest["files"]] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # Loaded elsewhere, unsharded, with no process group: DCP reshards.
    state = {"w": torch.zeros(8, 4), "b": torch.zeros(3)}
    load_sharded(tmp_path / "step-000003", state)
    assert torch.equal(state["w"], torch.arange(32, dtype=torch.float32).reshape(8, 4))
    assert torch.equal(state["b"], torch.ones(3))
    with pytest.raises(KeyError, match=r"has no \['step'\]"):
        load_sharded(tmp_path / "step-000003", {"step": torch.zeros(())})
    # DCP would pickle anything but a tensor (a BYTE_IO item no load reads): refused before anything is written.
    with pytest.raises(TypeError, match=r"save_sharded stores tensors only; \['step'\] are ints\. Store other state"):
        save_sharded(tmp_path / "step-000004", {"w": torch.ones(2), "step": 3}, metadata={}, token="tok")
    assert not (tmp_path / "step-000004").exists() and not list(tmp_path.glob(".step-000004*"))
    (tmp_path / "step-000003" / "__1_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointCorruptError, match=r"__1_0.distcp has 1 bytes"):
        load_sharded(tmp_path / "step-000003", state)


def _three_tensors(root: Path, checksum: str = "crc32") -> tuple[Path, dict]:
    import torch

    from lightning_scale.core.checkpoint.sharded import save_sharded

    state = {"big": torch.arange(50_000, dtype=torch.float32), "small": torch.ones(4), "mid": torch.randn(3000)}
    path = save_sharded(root / checkpoint_name(1), state, metadata={"global_step": 1}, token="tok", checksum=checksum)
    return path, state


def _flip(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
def test_a_load_hashes_the_shards_as_it_reads_them_and_names_a_corrupted_one(tmp_path: Path, checksum: str) -> None:
    import torch

    from lightning_scale.core.checkpoint.shard_reader import ShardReader
    from lightning_scale.core.checkpoint.sharded import load_sharded

    path, state = _three_tensors(tmp_path, checksum)
    assert all(checksum in e for e in verify(path)["files"])
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    assert load_sharded(path, into) == [] and all(torch.equal(into[k], v) for k, v in state.items())
    # Every byte read once: the file the load read whole is the one it hashed.
    reader = ShardReader(path, expected={e["path"]: e for e in verify(path)["files"]})
    import torch.distributed.checkpoint as dcp

    dcp.load({k: torch.zeros_like(v) for k, v in state.items()}, storage_reader=reader, no_dist=True)
    assert reader.hashed == ["__0_0.distcp"]

    shard = path / "__0_0.distcp"
    size = shard.stat().st_size
    _flip(shard, size // 2)  # inside a tensor's bytes: decodes fine, the hash says otherwise
    with pytest.raises(CheckpointCorruptError, match=rf"__0_0\.distcp does not match its {checksum}"):
        load_sharded(path, {k: torch.zeros_like(v) for k, v in state.items()})
    # A load of one small tensor reads less than half the file; the rest is hashed after.
    with pytest.raises(CheckpointCorruptError, match=rf"__0_0\.distcp does not match its {checksum}"):
        load_sharded(path, {"small": torch.zeros(4)})
    _flip(shard, size // 2)
    load_sharded(path, {"small": torch.zeros(4)})  # intact again
    _flip(shard, 10)  # a zip header: decoding fails first, the hash names the file
    with pytest.raises(CheckpointCorruptError, match=rf"__0_0\.distcp does not match its {checksum}"):
        load_sharded(path, {k: torch.zeros_like(v) for k, v in state.items()})


def test_paths_and_urls_name_one_place_and_a_protocol_nobody_installed_says_what_to_install(tmp_path: Path) -> None:
    import fsspec

    from lightning_scale.core.checkpoint.storage import RemotePath, as_path, renames_atomically

    assert as_path(str(tmp_path)) == tmp_path and renames_atomically(tmp_path)
    url = as_path("memory://storage-test/run")
    assert isinstance(url, RemotePath) and str(url) == "memory:///storage-test/run" and as_path(str(url)) == url
    assert not renames_atomically(url)  # written in place, the manifest last
    assert renames_atomically(as_path(f"file://{tmp_path}"))
    child = url / "step-000001"
    child.mkdir(parents=True, exist_ok=True)
    with (child / "a.json").open("wb") as f:
        f.write(b"{}")
    assert child.parent == url and child.name == "step-000001" and [p.name for p in url.iterdir()] == ["step-000001"]
    assert (child / "a.json").read_text() == "{}" and (child / "a.json").stat().st_size == 2
    assert (child / "a.json").relative_to(url).as_posix() == "step-000001/a.json"
    fsspec.filesystem("memory").rm("/storage-test", recursive=True)
    with pytest.raises(
        ValueError, match=r"Cannot open the checkpoint location 'nosuchfs://b/x'.*lightning-scale\[s3\]"
    ):
        as_path("nosuchfs://b/x")
    with pytest.raises(TypeError, match=r"must be a str or os.PathLike, got int"):
        as_path(3)
