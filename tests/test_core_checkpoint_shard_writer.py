"""StagingWriter writes real DCP checkpoints in one process (no process group): the digests it takes
while writing are the files' own, and staging reuses its host buffers."""

from __future__ import annotations

import hashlib
import re
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_scale.core.checkpoint.shard_writer import StagingWriter
from lightning_scale.core.checkpoint.storage import as_path

# DCP says it saves in one process, as asked (no_dist=True).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, torch.Tensor]:
    return {
        "weight": torch.arange(12.0).reshape(3, 4),
        "bias": torch.ones(4, dtype=torch.bfloat16),
        "step": torch.tensor(7),
    }


def _independent(data: bytes, checksum: str) -> str:
    return f"{zlib.crc32(data):08x}" if checksum == "crc32" else hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
def test_every_shard_file_is_hashed_as_it_is_written(tmp_path: Path, checksum: str) -> None:
    writer = StagingWriter(thread_count=2, checksum=checksum)
    path = tmp_path / "step-1"
    dcp.save(_state(), storage_writer=writer, checkpoint_id=path, no_dist=True)

    shards = sorted(p.name for p in path.glob("*.distcp"))
    assert sorted(p.name for p in path.iterdir()) == sorted([*shards, ".metadata"])
    assert len(shards) == 2  # one file per writer thread
    assert sorted(writer.digests) == shards  # the metadata is not a shard
    for name, (size, digest) in writer.digests.items():
        data = (path / name).read_bytes()
        assert (size, digest) == (len(data), _independent(data, checksum))
    assert writer.sync_files

    loaded = {k: torch.empty_like(v) for k, v in _state().items()}
    dcp.load(loaded, checkpoint_id=path, no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in _state().items())


def test_each_save_has_its_own_digests(tmp_path: Path) -> None:
    writer = StagingWriter()
    dcp.save(_state(), storage_writer=writer, checkpoint_id=tmp_path / "a", no_dist=True)
    first = writer.digests
    dcp.save({"other": torch.zeros(2)}, storage_writer=writer, checkpoint_id=tmp_path / "b", no_dist=True)
    assert writer.digests is not first and list(writer.digests) == ["__0_0.distcp"]
    data = (tmp_path / "b" / "__0_0.distcp").read_bytes()
    assert writer.digests["__0_0.distcp"] == (len(data), _independent(data, "crc32"))


def test_a_url_is_written_through_fsspec_without_fsync() -> None:
    url = "memory://shard-writer-test/step-1"
    writer = StagingWriter()
    dcp.save(_state(), storage_writer=writer, checkpoint_id=url, no_dist=True)
    assert not writer.sync_files
    remote = as_path(url)
    ((name, (size, digest)),) = writer.digests.items()
    data = remote.fs.cat_file(f"{remote.path}/{name}")
    assert (size, digest) == (len(data), _independent(data, "crc32"))
    remote.fs.rm(remote.path, recursive=True)


def test_a_stream_that_seeks_gets_no_digest(tmp_path: Path) -> None:
    writer = StagingWriter()
    writer.reset(tmp_path)
    with writer.fs.create_stream(tmp_path / "__0_0.distcp", "wb") as stream:
        stream.write(b"abcdef")
        stream.seek(0)
        stream.write(b"X")
    with writer.fs.create_stream(tmp_path / "__0_1.distcp", "wb") as stream:
        stream.write(b"abc")
        stream.write(memoryview(b"def"))
    with writer.fs.create_stream(tmp_path / "__0_1.distcp", "rb") as stream:
        assert stream.read() == b"abcdef"  # reading passes through
    assert (tmp_path / "__0_0.distcp").read_bytes() == b"Xbcdef"
    assert writer.digests == {"__0_1.distcp": (6, _independent(b"abcdef", "crc32"))}


def test_staging_reuses_its_host_buffers_until_the_tensors_change() -> None:
    writer = StagingWriter()
    state = _state()
    staged = writer.stage(state)
    assert all(torch.equal(staged[k], v) and staged[k].data_ptr() != v.data_ptr() for k, v in state.items())
    buffers = {k: v.data_ptr() for k, v in staged.items()}

    state["weight"] += 1
    again = writer.stage(state)
    assert {k: v.data_ptr() for k, v in again.items()} == buffers  # the same buffers, the new values
    assert torch.equal(again["weight"], state["weight"])

    state["weight"] = torch.zeros(5)
    rebuilt = writer.stage(state)  # only the tensor that changed shape gets a new buffer
    assert rebuilt["weight"].shape == (5,) and rebuilt["bias"].data_ptr() == buffers["bias"]
    assert not writer.stager.last_reused


def test_an_unknown_checksum_is_refused_with_the_choices() -> None:
    message = "checksum='md5' is not a checksum algorithm lightning-scale writes: choose one of ('crc32', 'sha256')"
    with pytest.raises(ValueError, match=re.escape(message)):
        StagingWriter(checksum="md5")
