"""Checkpoint save and load against the disk, ``torch.save`` and plain DCP; async blocking time.

    python benchmarks/checkpoint.py                     # GPT of ~100 M parameters + AdamW (~1.2 GB)
    python benchmarks/checkpoint.py --d-model 256 --layers 4 --rounds 2   # a quick look

One process holds a GPT and its AdamW state (a Lightning checkpoint as ``HybridParallelStrategy``
hands it to the IO plugin: model tensors, per-parameter optimizer state, loops, schedulers). Each
round runs every variant once (the order rotating), into a fresh directory; medians reported:

- disk (the bound): the same bytes written to one file with ``write`` + ``fsync``; read back cold
  (the pages evicted with ``posix_fadvise(DONTNEED)`` first) into a buffer allocated beforehand;
  each measured right before or after ours (the order alternating by round);
- ours: ``ShardedCheckpointIO.save_checkpoint`` (DCP shards, JSON state, per-file CRC-32 — the
  default checksum — manifest, fsync, atomic rename) and ``load_checkpoint`` into the live
  tensors (verification with checksums included), cold;
- torch: ``torch.save`` of the whole checkpoint + fsync, and ``torch.load`` (cold);
- dcp: plain ``dcp.save`` (``FileSystemWriter(sync_files=True)``, as many threads as ours) and
  ``dcp.load`` (cold; no verification);
- async: ``ShardedCheckpointIO(async_save=True)``: seconds until ``save_checkpoint`` returns
  (the snapshot into reused host buffers), then the wait for the background write; plain DCP
  ``async_save`` (its default stager, a fresh copy each time) until it returns; and a plain
  memory copy of the same tensors into preallocated buffers.

Ratios: ``save_fraction_of_disk`` = disk write / ours save (target >= 0.8) and ``load_fraction_of_disk``
= cold disk read / ours load (target >= 0.8): each pair is measured back to back, the order
alternating by round, and the figure is the median over pairs of rounds of their geometric mean,
which cancels the order (``*_by_round`` lists every round's ratio); ``*_vs_torch``, ``*_vs_dcp`` = ours / peer time;
``async_block_fraction`` = async return time / ours synchronous save (target <= 0.10);
``async_block_vs_memcpy`` (target <= 1.5) and ``dcp_async_block_vs_memcpy``; peak resident-memory
growth of each save as a fraction of the state's bytes (``*_peak_rss_growth_fraction``).

Prints ``BENCH checkpoint {json}`` last and writes benchmarks/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _common import RESULTS, emit
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from lightning_scale.models import GPT, GPTConfig
from lightning_scale.plugins import ShardedCheckpointIO


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _evict(root: Path) -> None:
    """Drop a directory's (or file's) pages from the page cache, so the next read comes from the disk."""
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _state(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    config = GPTConfig(
        n_layers=args.layers, d_model=args.d_model, n_heads=args.heads, block_size=args.seq, vocab_size=args.vocab
    )
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, args.vocab, (1, args.seq))).float().mean().backward()
    optimizer.step()
    checkpoint = {
        "epoch": 0,
        "global_step": 1,
        "pytorch-lightning_version": "2.6",
        "state_dict": dict(model.state_dict()),
        "optimizer_states": [get_optimizer_state_dict(model, optimizer)],
        "lr_schedulers": [{"last_epoch": 1, "base_lrs": [1e-3]}],
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1}}}},
        "callbacks": {},
    }
    return model, checkpoint


def _tensors(checkpoint: dict[str, Any]) -> list[torch.Tensor]:
    out = list(checkpoint["state_dict"].values())
    for entries in checkpoint["optimizer_states"][0]["state"].values():
        out.extend(v for v in entries.values() if isinstance(v, torch.Tensor))
    return out


def _flat(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    flat = {f"model/{k}": v for k, v in checkpoint["state_dict"].items()}
    for fqn, entries in checkpoint["optimizer_states"][0]["state"].items():
        flat.update({f"optim/{fqn}/{k}": v for k, v in entries.items()})
    return flat


def _timed(fn: Callable[[], Any]) -> tuple[float, int]:
    """Seconds of ``fn`` and the peak resident-memory growth during it (0 where it cannot be measured)."""
    base = _rss()
    tracked = _reset_peak()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, (max(0, _peak_rss() - base) if tracked else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6, help="an even number: the disk bound goes first in half")
    parser.add_argument(
        "--checksum", default="crc32", choices=["crc32", "sha256"], help="ShardedCheckpointIO(checksum=...)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=RESULTS / "checkpoint.json")
    args = parser.parse_args()
    if args.rounds < 2 or args.rounds % 2:
        parser.error(
            f"--rounds={args.rounds} must be an even number of at least 2 (each order of ours and the disk bound in half)"
        )

    model, checkpoint = _state(args)
    tensors = _tensors(checkpoint)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    blob = b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    buffers = [torch.empty_like(t) for t in tensors]
    into = bytearray(len(blob))  # touched once here, so the read bound pays no page faults
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    template = {"state_dict": checkpoint["state_dict"], "optimizer_states": checkpoint["optimizer_states"]}
    sync_io = ShardedCheckpointIO(checksum=args.checksum)
    async_io = ShardedCheckpointIO(async_save=True, checksum=args.checksum)
    times: dict[str, list[float]] = {}
    peaks: dict[str, list[int]] = {}

    def record(name: str, seconds: float, peak: int = 0) -> None:
        times.setdefault(name, []).append(seconds)
        peaks.setdefault(name, []).append(peak)

    def disk_write(i: int) -> None:
        with open(root / f"raw-{i}.bin", "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())

    def disk_read(i: int) -> None:  # into a buffer allocated once: the disk's time, not the allocator's
        with open(root / f"raw-{i}.bin", "rb", buffering=0) as f:
            view, done = memoryview(into), 0
            while n := f.readinto(view[done:]):
                done += n

    def ours(i: int) -> None:
        """Ours and the disk bound back to back (the order alternating): the disk's speed on this VM
        drifts by up to 2x within minutes, so each round's ratio compares like with like."""
        path, raw = root / f"ours-{i}", root / f"raw-{i}.bin"
        pairs = [
            ("disk_write", lambda: disk_write(i)),
            ("ours_save", lambda: sync_io.save_checkpoint(checkpoint, path)),
        ]
        for name, fn in pairs if i % 2 == 0 else pairs[::-1]:
            record(name, *_timed(fn))
        _evict(path), _evict(raw)
        pairs = [
            ("disk_read", lambda: disk_read(i)),
            ("ours_load", lambda: sync_io.load_checkpoint(path, template=template)),
        ]
        for name, fn in pairs if i % 2 == 0 else pairs[::-1]:
            record(name, *_timed(fn))
        shutil.rmtree(path)
        raw.unlink()

    def torch_save(i: int) -> None:
        path = root / f"torch-{i}.pt"

        def save() -> None:
            with open(path, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())

        record("torch_save", *_timed(save))
        _evict(path)
        record("torch_load", *_timed(lambda: torch.load(path, map_location="cpu", weights_only=True)))
        path.unlink()

    def plain_dcp(i: int) -> None:
        path = root / f"dcp-{i}"
        flat = _flat(checkpoint)
        record(
            "dcp_save",
            *_timed(
                lambda: dcp.save(
                    flat,
                    storage_writer=FileSystemWriter(path, sync_files=True, thread_count=sync_io.thread_count),
                    no_dist=True,
                )
            ),
        )
        _evict(path)
        record("dcp_load", *_timed(lambda: dcp.load(flat, storage_reader=FileSystemReader(path), no_dist=True)))
        shutil.rmtree(path)

    def asynchronous(i: int) -> None:
        path = root / f"async-{i}"
        record("async_block", *_timed(lambda: async_io.save_checkpoint(checkpoint, path)))
        record("async_wait", *_timed(async_io.wait))
        shutil.rmtree(path)
        path = root / f"dcp-async-{i}"
        flat = _flat(checkpoint)
        pending: list[Any] = []
        record(
            "dcp_async_block",
            *_timed(
                lambda: pending.append(
                    dcp.async_save(
                        flat, storage_writer=FileSystemWriter(path, thread_count=sync_io.thread_count), no_dist=True
                    )
                )
            ),
        )
        pending[0].result()
        shutil.rmtree(path)

        def memcpy() -> None:
            for dst, src in zip(buffers, tensors):
                dst.copy_(src)

        record("memcpy", *_timed(memcpy))

    variants = [ours, torch_save, plain_dcp, asynchronous]
    asynchronous(-1)  # warm-up: the async buffers, the thread, the first DCP plans
    times.clear(), peaks.clear()
    for i in range(args.rounds):
        order = variants[i % len(variants) :] + variants[: i % len(variants)]
        for variant in order:
            variant(i)
    shutil.rmtree(root, ignore_errors=True)

    med = {name: statistics.median(values) for name, values in times.items()}
    peak = {name: max(values) for name, values in peaks.items()}
    gb = state_bytes / 1e9

    def paired(bound: str, ours: str) -> float:
        """bound / ours, measured back to back: the median over pairs of rounds (one with the bound
        first, one with ours first) of the two rounds' geometric mean. On this VM whichever runs
        second is 1.5-2x slower (the host is still flushing or evicting the first), so a ratio from
        one order alone measures the order."""
        ratios = [b / o for b, o in zip(times[bound], times[ours])]
        return round(statistics.median(math.sqrt(a * b) for a, b in zip(ratios[0::2], ratios[1::2])), 3)

    report = {
        "state_bytes": state_bytes,
        "parameters": sum(p.numel() for p in model.parameters()),
        "rounds": args.rounds,
        "checksum": args.checksum,
        "seconds": {k: round(v, 4) for k, v in med.items()},
        "gb_per_s": {k: round(gb / v, 3) for k, v in med.items() if k != "async_block"},
        "save_fraction_of_disk": paired("disk_write", "ours_save"),
        "load_fraction_of_disk": paired("disk_read", "ours_load"),
        "save_fraction_of_disk_by_round": [round(d / o, 3) for d, o in zip(times["disk_write"], times["ours_save"])],
        "load_fraction_of_disk_by_round": [round(d / o, 3) for d, o in zip(times["disk_read"], times["ours_load"])],
        "save_ratio_vs_torch": round(med["ours_save"] / med["torch_save"], 3),
        "load_ratio_vs_torch": round(med["ours_load"] / med["torch_load"], 3),
        "save_ratio_vs_dcp": round(med["ours_save"] / med["dcp_save"], 3),
        "load_ratio_vs_dcp": round(med["ours_load"] / med["dcp_load"], 3),
        "async_block_fraction": round(med["async_block"] / med["ours_save"], 3),
        "async_block_vs_memcpy": round(med["async_block"] / med["memcpy"], 3),
        "dcp_async_block_vs_memcpy": round(med["dcp_async_block"] / med["memcpy"], 3),
        "save_peak_rss_growth_fraction": round(peak["ours_save"] / state_bytes, 3),
        "async_save_peak_rss_growth_fraction": round(peak["async_block"] / state_bytes, 3),
        "load_peak_rss_growth_fraction": round(peak["ours_load"] / state_bytes, 3),
        "torch_save_peak_rss_growth_fraction": round(peak["torch_save"] / state_bytes, 3),
        "load_average_at_start": os.getloadavg()[0],
    }
    emit("checkpoint", report, args.out)


if __name__ == "__main__":
    main()
