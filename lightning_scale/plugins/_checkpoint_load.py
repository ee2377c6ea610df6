"""Loading a sharded checkpoint as Lightning's checkpoint dict: into the live tensors of every rank
(:func:`load_into`), or whole in one process (:func:`read_whole`, :func:`load_full_checkpoint`).

Every file read is one the manifest lists, checked against it: the small files (DCP's metadata
among them, before it is unpickled) up front, the shards as they are read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_scale._lightning_compat import load_module_state, migrate_checkpoint
from lightning_scale.core.checkpoint.format import is_shard_file, read_listed, read_manifest, verify
from lightning_scale.core.checkpoint.sharded import load_sharded, read_tensor_metadata, verify_distributed
from lightning_scale.core.checkpoint.state import decode
from lightning_scale.core.checkpoint.storage import AnyPath, as_path, is_url
from lightning_scale.plugins._checkpoint_layout import (
    EXTRA,
    MODEL,
    STRATEGY,
    TRAINER_STATE,
    flatten_template,
    load_whole,
    restored_optimizer,
)

__all__ = ["load_from_checkpoint", "load_full_checkpoint", "load_into", "rank_file", "read_whole"]


def rank_file(rank: int) -> str:
    """The JSON file of one rank's random-number states."""
    return f"rank-{rank:05d}.json"


def _with_info(checkpoint: dict[str, Any], path: AnyPath, manifest: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """``checkpoint["lightning_scale"]``: the directory, its manifest and this rank's random states (and,
    from a whole load, each optimizer's parameter names by group)."""
    name = rank_file(rank)
    listed = any(e.get("path") == name for e in manifest["files"])
    checkpoint.setdefault("lightning_scale", {}).update(
        path=str(path),
        manifest=manifest,
        rng=json.loads(read_listed(path, manifest, name))["rng"] if listed else None,
    )
    return checkpoint


def read_whole(path: AnyPath, *, verified: bool = False) -> dict[str, Any]:
    """The checkpoint dict with every tensor whole on the CPU, read by this process alone (no collectives).
    ``verified``: every file was checked already (the shards are then not hashed again)."""
    small = lambda _, entry: not is_shard_file(entry["path"])  # noqa: E731 - the shards are hashed as they are read
    manifest = read_manifest(path) if verified else verify(path, checksums=small)
    return _with_info(load_whole(path, manifest, hash_shards=not verified), path, manifest, 0)


def load_into(
    path: AnyPath, template: Mapping[str, Any], *, group: dist.ProcessGroup | None, strict: bool, verified: bool
) -> dict[str, Any]:
    """Every rank: the checkpoint loaded into ``template``'s tensors in place (any layout to any other),
    the rest of the checkpoint dict decoded around them. ``verified``: every file was checked already
    (by ``latest``); else the small files are checked first and the shards hashed as they are read."""
    manifest = read_manifest(path) if verified else verify_distributed(path, group=group, shards=False)
    saved = read_tensor_metadata(path, manifest)
    extras = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in saved.items() if k.startswith(f"{EXTRA}/")
    }
    doc = json.loads(read_listed(path, manifest, TRAINER_STATE))
    if "optimizer_states" not in doc:
        # Saved with weights only: Lightning itself says so if it wants the optimizers' state.
        template = {k: v for k, v in template.items() if k != "optimizer_states"}
    flat, numbers = flatten_template(template)
    missing = load_sharded(path, {**flat, **extras}, group=group, strict=strict, verified=True if verified else "files")
    checkpoint = decode(doc, extras)
    checkpoint["state_dict"] = {
        k: v for k, v in (template.get("state_dict") or {}).items() if f"{MODEL}/{k}" not in missing
    }
    if "strategy_state" in template:
        checkpoint["strategy_state"] = {
            k: v for k, v in template["strategy_state"].items() if f"{STRATEGY}/{k}" not in missing
        }
    if "optimizer_states" in template:
        saved_optimizers = checkpoint.get("optimizer_states") or []
        checkpoint["optimizer_states"] = [
            restored_optimizer(
                state, i, saved_optimizers[i]["param_groups"] if i < len(saved_optimizers) else None, numbers
            )
            for i, state in enumerate(template["optimizer_states"])
        ]
    rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
    return _with_info(checkpoint, path, manifest, rank)


def load_full_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A sharded checkpoint directory as one Lightning checkpoint dict, every tensor whole on the CPU,
    read (and verified) by this process alone: what ``torch.load`` gives for a ``.ckpt`` file (the
    optimizer states as ``optimizer.state_dict()`` gives them), plus a ``"lightning_scale"`` entry
    (the directory, its manifest, this process's random states, each optimizer's parameter names by
    group: ``optimizer_param_names[i][g][n]`` is the name of parameter ``params[n]`` of group ``g``)."""
    return read_whole(as_path(path))


def load_from_checkpoint(cls: type, path: str | os.PathLike, *, strict: bool | None = None, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint`` for a sharded checkpoint directory: the module built from the saved
    hyper-parameters (``kwargs`` override them) with the whole weights, in one process."""
    local = None if is_url(path) else os.fspath(path)
    checkpoint = migrate_checkpoint(load_full_checkpoint(path), checkpoint_path=local)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {}).update(kwargs)
    return load_module_state(cls, checkpoint, strict=strict, **kwargs)
