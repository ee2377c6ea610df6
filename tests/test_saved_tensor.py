"""A ``torch.save``'d tensor found without ``torch.load`` (``lightning_scale.core.checkpoint.saved_tensor``), and a
checkpoint load reading large tensors straight into their destinations (``ShardReader``). No process group."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import lightning_scale.core.checkpoint.shard_reader as shard_reader
from lightning_scale.core.checkpoint.format import CheckpointCorruptError, checkpoint_name, verify
from lightning_scale.core.checkpoint.saved_tensor import (
    archive_directory,
    leading_tensor_range,
    stored_tensor,
    tensor_range,
)

_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int8,
    torch.bool,
    torch.complex64,
]


def _value(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (7,), (300, 513), (2, 3, 4)], ids=str)
def test_the_tensor_is_found_from_the_whole_archive_and_from_its_two_ends(dtype: torch.dtype, shape: tuple) -> None:
    tensor = _value(shape, dtype)
    data = _saved(tensor)
    assert torch.equal(stored_tensor(memoryview(data)), tensor)
    # From the last 4 KB (the directory) and the first bytes up to past data/0's local header only.
    tail = data[-4096:]
    directory = archive_directory(tail, len(data))
    assert directory is not None
    head = data[: directory["data/0"].header_offset + 1024]
    found = tensor_range(head, directory)
    assert found is not None and found.dtype == dtype and found.size == shape
    raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    assert data[found.start : found.start + found.nbytes] == raw
    # From the first 4 KB alone (a load reading front to back), confirmed by the directory after.
    assert leading_tensor_range(data[:4096], len(data)) == found


def test_anything_but_one_plain_contiguous_storage_is_left_to_torch_load() -> None:
    base = torch.arange(40, dtype=torch.float32)
    view = base[5:25]  # saved with its whole storage: an offset into it
    assert torch.equal(stored_tensor(memoryview(_saved(view))), view)
    assert stored_tensor(memoryview(_saved(base.reshape(5, 8).t()))) is None  # not contiguous
    assert stored_tensor(memoryview(_saved([base, base + 1]))) is None  # a list, two storages
    assert stored_tensor(memoryview(_saved({"a": base}))) is None
    data = _saved(base)
    assert archive_directory(data[-100:], len(data)) is None  # the directory is not all in the bytes given
    assert archive_directory(b"not a zip at all" * 10, 160) is None
    directory = archive_directory(data, len(data))
    assert tensor_range(data[:40], directory) is None  # the head stops before data.pkl ends
    assert leading_tensor_range(data[:40], len(data)) is None
    assert leading_tensor_range(_saved(base.reshape(5, 8).t())[:4096], len(data)) is None


def _saved_checkpoint(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    from lightning_scale.core.checkpoint.sharded import save_sharded

    state = {
        "w": _value((300, 257), torch.float32, 1),
        "h": _value((129, 70), torch.bfloat16, 2),
        "i": _value((5000,), torch.int64, 3),
        "m": _value((64, 33), torch.bool, 4),
        "c": _value((17, 9), torch.complex64, 5),
        "s": _value((), torch.float32, 6),
    }
    path = save_sharded(root / checkpoint_name(1), state, metadata={"global_step": 1}, token="t", thread_count=2)
    return path, state


@pytest.fixture
def direct_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every item read straight into its destination (no size floor); counts the items decoded from a buffer."""
    monkeypatch.setattr(shard_reader, "_DIRECT_MIN", 0)
    decoded: list[int] = []
    original = shard_reader._decode

    def counting(data: memoryview, items: list, planner: object) -> None:
        decoded.append(len(items))
        original(data, items, planner)

    monkeypatch.setattr(shard_reader, "_decode", counting)
    return decoded


def test_a_load_reads_tensors_into_their_destinations_and_still_hashes_every_byte(tmp_path: Path, direct_reads) -> None:
    from lightning_scale.core.checkpoint.sharded import load_sharded

    path, state = _saved_checkpoint(tmp_path)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    assert load_sharded(path, into) == []
    assert all(torch.equal(into[k], v) for k, v in state.items())
    assert direct_reads == []  # every tensor went straight in
    # A destination of another dtype is cast from a buffer; one narrowed across its columns, too.
    wide = {"w": torch.zeros(300, 257, dtype=torch.float64), "i": torch.zeros(5000, dtype=torch.int64)}
    load_sharded(path, wide, strict=False)
    assert torch.equal(wide["w"], state["w"].double()) and torch.equal(wide["i"], state["i"])
    assert direct_reads == [1]
    # Corruption inside a tensor's bytes, read into the destination, is found by the checksum.
    shard = next(p for p in sorted(path.glob("__0_*.distcp")))
    entry = next(e for e in verify(path)["files"] if e["path"] == shard.name)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=rf"{shard.name} does not match its crc32"):
        load_sharded(path, {k: torch.zeros_like(v) for k, v in state.items()})
    # A damaged archive directory: the item is read through a buffer, and the checksum names the file.
    data[len(data) // 2] ^= 0x01
    data[-30] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=rf"{shard.name} does not match its crc32"):
        load_sharded(path, {k: torch.zeros_like(v) for k, v in state.items()})
    assert entry["bytes"] == len(data)


def test_one_tensor_under_two_names_is_read_through_buffers_so_its_checksum_sees_the_file(
    tmp_path: Path, direct_reads
) -> None:
    """Two keys sharing one destination (tied weights): a direct read of one copy could be hashed
    after the other copy overwrote it, hiding a corrupted copy. Both go through buffers instead."""
    from lightning_scale.core.checkpoint.sharded import load_sharded, save_sharded

    weight = _value((300, 257), torch.float32, 7)
    path = save_sharded(tmp_path / checkpoint_name(1), {"a": weight, "b": weight}, metadata={}, token="t")
    shared = torch.zeros_like(weight)
    load_sharded(path, {"a": shared, "b": shared})
    assert torch.equal(shared, weight) and direct_reads == [1, 1]
    shard = next(iter(sorted(path.glob("__0_*.distcp"))))
    data = bytearray(shard.read_bytes())
    data[len(data) // 4] ^= 0x01  # inside the first copy
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=rf"{shard.name} does not match its crc32"):
        load_sharded(path, {"a": shared, "b": shared})


def test_an_archive_the_direct_path_cannot_parse_is_read_through_a_buffer(
    tmp_path: Path, direct_reads, monkeypatch
) -> None:
    from lightning_scale.core.checkpoint.sharded import load_sharded

    def broken(*args: object) -> None:
        raise TypeError("a pickle of floats")

    monkeypatch.setattr(shard_reader, "leading_tensor_range", broken)
    path, state = _saved_checkpoint(tmp_path)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    load_sharded(path, into)
    assert all(torch.equal(into[k], v) for k, v in state.items()) and len(direct_reads) == len(state)


def test_a_stream_hash_raises_what_hashing_raised_and_bounds_what_waits() -> None:
    import threading
    import zlib

    from lightning_scale.core.checkpoint.checksums import StreamHash

    chunks = [bytes([i]) * 1000 for i in range(50)]
    digest = StreamHash("crc32", limit=3000)
    gate, peak = threading.Event(), []
    digest.update(b"", done=gate.wait)  # holds the hashing back until the queue is full
    waiting = threading.Thread(target=lambda: [digest.update(c) for c in chunks])
    waiting.start()
    waiting.join(0.3)
    peak.append(digest._waiting)
    assert waiting.is_alive() and peak[0] <= 3000  # blocked at the limit, not queueing all 50 KB
    gate.set()
    waiting.join(5)
    assert digest.hexdigest() == f"{zlib.crc32(b''.join(chunks)):08x}"

    def fail() -> None:
        raise OSError("hash worker failed")

    failing = StreamHash("sha256")
    failing.update(b"x", done=fail)
    with pytest.raises(OSError, match="hash worker failed"):
        failing.hexdigest()
    with pytest.raises(OSError, match="hash worker failed"):
        failing.update(b"y")


def test_a_destination_sliced_by_rows_is_read_into_in_place(tmp_path: Path, direct_reads) -> None:
    """A resharded load (FSDP's dim-0 shards) reads each saved piece into its rows of the destination."""
    import torch.distributed.checkpoint as dcp

    from lightning_scale.core.checkpoint.shard_reader import ShardReader, TensorsOnlyLoadPlanner

    path, state = _saved_checkpoint(tmp_path)
    big = torch.zeros(600, 257)
    reader = ShardReader(path, expected={e["path"]: e for e in verify(path)["files"]})
    dcp.load({"w": big[300:]}, storage_reader=reader, planner=TensorsOnlyLoadPlanner(), no_dist=True)
    assert torch.equal(big[300:], state["w"]) and not big[:300].any()
