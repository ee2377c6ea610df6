"""Read wandb's offline run files back (``offline-run-*/run-<id>.wandb``) without wandb's service.

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic, version), then records in
32 KiB blocks, each with a 7-byte header (CRC32, length, type: full / first / middle / last)
holding a serialized ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb run file")
    out, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        pos += _HEADER
        if length == 0 and kind == 0:  # block padding
            pos += left - _HEADER
            continue
        if pos + length > len(data):  # the writer is still appending this record: read up to the last whole one
            break
        pending += data[pos : pos + length]
        pos += length
        if kind in (_FULL, _LAST):
            out.append(pending)
            pending = b""
    return out


def offline_runs(root: Path) -> list[dict[str, Any]]:
    """Every offline run under ``root``: its id (``id`` from the run record, ``dir_id`` from the
    directory name), group, job type, project and config keys."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted(Path(root).rglob("offline-run-*/run-*.wandb")):
        # offline-run-<time>-<id>: the id is there even when the process was killed before the run record
        # reached the file.
        info: dict[str, Any] = {"dir": path.parent, "config": {}, "dir_id": path.parent.name.rsplit("-", 1)[-1]}
        for raw in _records(path):
            record = pb.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                info.update(
                    id=record.run.run_id,
                    group=record.run.run_group,
                    job_type=record.run.job_type,
                    project=record.run.project,
                )
                items = record.run.config.update
            elif kind == "config":
                items = record.config.update
            else:
                continue
            for item in items:
                key = item.key or "/".join(item.nested_key)
                info["config"][key] = json.loads(item.value_json)
        runs.append(info)
    return runs
