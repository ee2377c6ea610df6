"""``lightning-scale-ckpt``: look into, check and consolidate sharded checkpoints, in one process.

    lightning-scale-ckpt inspect CHECKPOINT [--tensors] [--json]
    lightning-scale-ckpt verify CHECKPOINT_OR_DIRECTORY ...
    lightning-scale-ckpt consolidate CHECKPOINT OUT [--dtype bf16] [--hf]

``consolidate`` writes the whole model's weights as one safetensors file: ``OUT`` itself when it
ends in ``.safetensors``, else ``OUT/model.safetensors`` in the directory ``OUT``, with
``OUT/config.json`` for a Hugging Face model, so ``from_pretrained(OUT)`` loads it (a Hugging Face
model's tensors get the HF model's names either way; ``--hf`` asks for the directory and refuses a
checkpoint with no HF model). It streams: one tensor is read from the shards, gathered whole and
written at a time, so memory stays bounded by the largest tensor, not the model.

Every command checks a checkpoint against its manifest before it reads anything else, and reads
DCP's metadata only through :mod:`lightning_scale.core.checkpoint.dcp_metadata` (no code a checkpoint chose
runs, no file its manifest does not list is opened).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_scale.core.checkpoint.format import (
    MANIFEST,
    CheckpointCorruptError,
    is_shard_file,
    scan,
    verify,
)
from lightning_scale.core.checkpoint.shard_reader import SafeFileSystemReader
from lightning_scale.core.checkpoint.sharded import (
    full_tensors_from,
    read_tensor_metadata,
    tensor_entries,
    verify_distributed,
)
from lightning_scale.core.checkpoint.storage import AnyPath, as_path

__all__ = ["consolidate", "inspect", "main"]

_MODEL = "model/"
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_CAST = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def inspect(path: AnyPath, *, tensors: bool = False) -> dict[str, Any]:
    """What a checkpoint holds: the manifest's facts and its tensors by kind (no tensor data is read;
    the manifest's files are checked for presence and size, the small ones' checksums too)."""
    path = as_path(path)
    manifest = verify(path, checksums=lambda _, entry: not is_shard_file(entry["path"]))
    saved = read_tensor_metadata(path, manifest)
    kinds: dict[str, dict[str, int]] = {}
    listing = []
    for key, meta in sorted(saved.items()):
        kind = key.split("/", 1)[0]
        size = _numel(meta.size) * meta.properties.dtype.itemsize
        entry = kinds.setdefault(kind, {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += size
        listing.append(
            {"key": key, "shape": list(meta.size), "dtype": str(meta.properties.dtype).removeprefix("torch.")}
        )
    info = {
        "path": str(path),
        "global_step": manifest.get("global_step"),
        "epoch": manifest.get("epoch"),
        "layout": manifest.get("layout"),
        "world_size": manifest.get("world_size"),
        "versions": manifest.get("versions"),
        "wandb_run_id": manifest.get("wandb_run_id"),
        "huggingface": (manifest.get("huggingface") or {}).get("class"),
        "files": len(manifest["files"]),
        "file_bytes": sum(f["bytes"] for f in manifest["files"]),
        "by_kind": kinds,
        "metadata": manifest.get("metadata"),
    }
    if tensors:
        info["tensors"] = listing
    return info


def _weights(manifest: dict[str, Any], saved: dict[str, Any], prefix: str) -> list[tuple[str, str]]:
    """``(checkpoint key, output name)`` of every model tensor, with the tied copies the manifest lists."""
    names = {key[len(_MODEL) :]: key for key in saved if key.startswith(_MODEL)}
    for group in manifest.get("tied") or []:
        for alias in group[1:]:
            if group[0] in names:
                names.setdefault(alias, names[group[0]])
    out = []
    for name in sorted(names):
        if prefix and not name.startswith(prefix):
            continue
        out.append((names[name], name[len(prefix) :]))
    return out


def consolidate(path: AnyPath, out: Path, *, dtype: str | None = None, hf: bool | None = None) -> Path:
    """Write the checkpoint's whole weights as one safetensors file, one tensor in memory at a time:
    ``out`` itself when it ends in ``.safetensors``, else ``out/model.safetensors`` (``out`` a directory).

    A Hugging Face model's tensors are named as in the HF model, and a directory gets its
    ``config.json`` too. ``hf=True``: that directory (``out`` must not name a ``.safetensors`` file;
    the checkpoint must hold an HF model); ``False``: the LightningModule's names. Returns the file written."""
    path, out = as_path(path), Path(out)
    if dtype is not None and dtype not in _CAST:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(_CAST)} (or None: as saved).")
    single = out.suffix == ".safetensors"
    if hf and single:
        raise ValueError(
            f"OUT={str(out)!r} names a .safetensors file, but --hf writes a Hugging Face directory (model.safetensors "
            "and config.json): name a directory, or drop --hf to write that one file."
        )
    manifest = verify_distributed(path)  # every file present and intact, DCP's metadata safe, before a byte is written
    metadata = SafeFileSystemReader(path, manifest=manifest).read_metadata()  # read once for every tensor
    saved = tensor_entries(metadata)
    huggingface = manifest.get("huggingface") or None
    hf = huggingface is not None if hf is None else hf
    if hf and huggingface is None:
        raise ValueError(f"{path} holds no Hugging Face model (its manifest records none): drop --hf.")
    prefix = f"{huggingface['prefix']}." if hf and huggingface["prefix"] else ""
    items = _weights(manifest, saved, prefix)
    if not items:
        raise ValueError(f"{path} has no model tensors{f' under {prefix!r}' if prefix else ''} to consolidate.")
    if single:
        out.parent.mkdir(parents=True, exist_ok=True)
        file = out
    else:
        out.mkdir(parents=True, exist_ok=True)
        file = out / "model.safetensors"
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "global_step": str(manifest.get("global_step"))}}
    offset = 0
    plan = []
    for key, name in items:
        meta = saved[key]
        target = (
            _CAST[dtype] if dtype is not None and meta.properties.dtype.is_floating_point else meta.properties.dtype
        )
        if target not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{key} is {target}, which safetensors cannot store.")
        size = _numel(meta.size) * target.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[target],
            "shape": list(meta.size),
            "data_offsets": [offset, offset + size],
        }
        plan.append((key, target, size))
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = file.with_name(f".{file.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for key, target, size in plan:
            tensor = full_tensors_from(path, [key], metadata=metadata)[key].to(target).contiguous()
            data = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
            if len(data) != size:
                raise RuntimeError(f"{key}: wrote {len(data)} bytes, expected {size}.")
            f.write(data)  # the tensor's own bytes, no copy
            del tensor, data
    tmp.replace(file)
    if hf and not single:
        config = dict(huggingface["config"])
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return file


def _verify_all(targets: Sequence[str]) -> int:
    """``verify``: every checkpoint under each target (a checkpoint, or a directory of them), every file
    against its checksum and DCP's metadata against the rules of a load; every directory that looks
    like a checkpoint but is not one (no manifest, an unreadable one) is reported too. 1 if any is broken."""
    status = 0
    for target in map(as_path, targets):
        good, bad = ([], []) if (target / MANIFEST).is_file() else scan(target)
        for path, why in bad:
            print(f"BROKEN {path}: not a checkpoint: {why}")
            status = 1
        for path in [c.path for c in good] or ([] if bad else [target]):
            try:
                manifest = verify_distributed(path)
            except CheckpointCorruptError as err:
                print(f"BROKEN {path}: {err}")
                status = 1
            else:
                print(f"OK     {path} (step {manifest.get('global_step')}, {len(manifest['files'])} files)")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-scale-ckpt", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="the manifest's facts and the tensors, by kind")
    p.add_argument("checkpoint")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser("verify", help="check every file against the manifest (exit 1 if any is broken)")
    p.add_argument("paths", nargs="+", help="checkpoint directories, or directories holding checkpoints")
    p = sub.add_parser("consolidate", help="write the whole weights as one safetensors file")
    p.add_argument("checkpoint")
    p.add_argument("out", help="OUT.safetensors, or a directory (model.safetensors + config.json for HF models)")
    p.add_argument("--dtype", choices=sorted(_CAST), default=None, help="cast floating-point weights")
    p.add_argument(
        "--hf", action="store_true", default=None, help="a Hugging Face directory (model.safetensors + config.json)"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "verify":
            return _verify_all(args.paths)
        if args.command == "inspect":
            info = inspect(args.checkpoint, tensors=args.tensors)
            if args.json:
                print(json.dumps(info, indent=2))
            else:
                for key, value in info.items():
                    if key != "tensors":
                        print(f"{key}: {value}")
                for t in info.get("tensors", []):
                    print(f"  {t['key']}  {t['dtype']}{t['shape']}")
            return 0
        file = consolidate(args.checkpoint, Path(args.out), dtype=args.dtype, hf=args.hf)
        print(f"wrote {file}")
        return 0
    except (CheckpointCorruptError, ValueError, OSError) as err:
        print(f"lightning-scale-ckpt {args.command}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
