"""How a Lightning checkpoint dict maps onto a sharded checkpoint: flat DCP keys for every tensor
(``model/<fqn>``, ``optim/<i>/<fqn>/<state>``, ``extra/<json path>``, ``strategy/<key>``) and the JSON of
the rest, and back. ``strategy_state``: a flat mapping of tensors the strategy keeps besides the model and
its optimizers, every rank its own (a plain tensor several ranks hold under one key is written once)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_scale.core.checkpoint.format import CheckpointCorruptError, read_listed
from lightning_scale.core.checkpoint.sharded import full_tensors_from
from lightning_scale.core.checkpoint.state import decode, encode
from lightning_scale.core.checkpoint.storage import AnyPath

__all__ = [
    "EXTRA",
    "MODEL",
    "OPTIM",
    "STRATEGY",
    "TRAINER_STATE",
    "add_optimizer_layout",
    "flatten_template",
    "json_bytes",
    "load_whole",
    "optimizer_layout",
    "restored_optimizer",
    "split_checkpoint",
    "versions",
]

TRAINER_STATE = "trainer_state.json"
MODEL, OPTIM, EXTRA, STRATEGY = "model", "optim", "extra", "strategy"
_LENIENT = ("hyper_parameters", "datamodule_hyper_parameters")


def split_checkpoint(checkpoint: Mapping[str, Any], rank: int) -> tuple[dict[str, Tensor], Any]:
    """``(tensors, doc)``: every tensor of a Lightning checkpoint under a flat key, and the JSON of the rest
    (a plain tensor of that rest is kept from rank 0 only, as Lightning saves rank 0's state).
    :func:`optimizer_layout` is this rank's part of what the doc needs besides (:func:`add_optimizer_layout`)."""
    tensors: dict[str, Tensor] = {}
    for name, value in (checkpoint.get("state_dict") or {}).items():
        if not isinstance(value, Tensor):
            raise TypeError(
                f"state_dict[{name!r}] is a {type(value).__name__}: a module's extra state must be a tensor to be "
                "saved in a sharded checkpoint."
            )
        tensors[f"{MODEL}/{name}"] = value
    optimizers = []
    for i, state in enumerate(checkpoint.get("optimizer_states") or []):
        for fqn, entries in state.get("state", {}).items():
            for key, value in entries.items():
                if value is None:
                    continue
                if not isinstance(value, Tensor):
                    if isinstance(value, bool) or not isinstance(value, (int, float)):
                        raise TypeError(
                            f"Optimizer {i}'s state {key!r} of {fqn!r} is a {type(value).__name__}; a sharded "
                            "checkpoint holds tensors and numbers per parameter."
                        )
                    value = torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)
                tensors[f"{OPTIM}/{i}/{fqn}/{key}"] = value
        optimizers.append({"param_groups": [hyper_parameters_of(g) for g in state.get("param_groups", [])]})
    for key, value in (checkpoint.get("strategy_state") or {}).items():
        if not isinstance(value, Tensor):
            raise TypeError(f"strategy_state[{key!r}] is a {type(value).__name__}; it holds tensors only.")
        tensors[f"{STRATEGY}/{key}"] = value
    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states", "strategy_state")}
    if "optimizer_states" in checkpoint:
        rest["optimizer_states"] = optimizers
    extras: dict[str, Tensor] = {}
    doc = encode(rest, extras, prefix=EXTRA, lenient=lambda p: bool(p) and p[0] in _LENIENT)
    for key, value in extras.items():
        # Rank 0's state is the checkpoint's (as with Lightning's rank-0 save); a DTensor needs every rank's shard.
        if rank == 0 or isinstance(value, DTensor):
            tensors[key] = value
    return tensors, doc


def optimizer_layout(checkpoint: Mapping[str, Any]) -> list[dict[str, Any]]:
    """This rank's part of what a whole load needs to give each optimizer's state in torch's own form
    (``state`` by parameter index): per optimizer, the parameter names of each group in order, and
    which state entries are Python numbers (the shards hold them as 0-d tensors)."""
    out = []
    for state in checkpoint.get("optimizer_states") or []:
        numbers = {
            f"{fqn}/{key}": "int" if isinstance(value, int) else "float"
            for fqn, entries in state.get("state", {}).items()
            for key, value in entries.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        out.append({"params": [list(g.get("params", [])) for g in state.get("param_groups", [])], "numbers": numbers})
    return out


def add_optimizer_layout(doc: Any, parts: list[list[dict[str, Any]]]) -> None:
    """Every rank's :func:`optimizer_layout` (in rank order) into the doc's optimizers: a group's names
    are each rank's in turn, first occurrence kept, so a pipeline's stages follow one another (mesh
    ``(dp, pp, tp)``: the ranks of one replica in stage order) and replicas add nothing."""
    optimizers = doc.get("optimizer_states") if isinstance(doc, dict) else None
    for i, optimizer in enumerate(optimizers or []):
        groups: list[list[str]] = []
        numbers: dict[str, str] = {}
        for part in parts:
            if i >= len(part):
                continue
            for g, names in enumerate(part[i]["params"]):
                while len(groups) <= g:
                    groups.append([])
                groups[g].extend(n for n in names if n not in groups[g])
            numbers.update(part[i]["numbers"])
        optimizer["param_names"], optimizer["numbers"] = groups, numbers


def load_whole(path: AnyPath, manifest: Mapping[str, Any], *, hash_shards: bool = True) -> dict[str, Any]:
    """Every tensor of the checkpoint whole, on the CPU, in the structure ``torch.load`` gives for
    Lightning's ``.ckpt`` (optimizer states as ``optimizer.state_dict()`` gives them; the parameter
    names of each optimizer's groups under ``["lightning_scale"]["optimizer_param_names"]``).
    ``manifest``: the checkpoint's, its small files checked already; ``hash_shards``: hash the shard
    files as they are read (:func:`full_tensors_from`)."""
    loaded = full_tensors_from(path, manifest=manifest if hash_shards else None)
    checkpoint = decode(json.loads(read_listed(path, manifest, TRAINER_STATE)), loaded)
    checkpoint["state_dict"] = state = {k[len(MODEL) + 1 :]: v for k, v in loaded.items() if k.startswith(f"{MODEL}/")}
    strategy_state = {k[len(STRATEGY) + 1 :]: v for k, v in loaded.items() if k.startswith(f"{STRATEGY}/")}
    if strategy_state:
        checkpoint["strategy_state"] = strategy_state
    for names in manifest.get("tied") or []:
        for alias in names[1:]:
            if names[0] in state:
                state[alias] = state[names[0]]  # one tensor under every name, as the module shares it
    names = []
    for i, optimizer in enumerate(checkpoint.get("optimizer_states") or []):
        by_name = unflatten_optimizer(loaded, i)
        if "param_names" in optimizer:
            names.append(optimizer["param_names"])
            checkpoint["optimizer_states"][i] = _torch_optimizer_state(path, by_name, optimizer)
        else:  # written before parameter orders were recorded: state by parameter name, groups without "params"
            names.append(None)
            optimizer["state"] = by_name
    checkpoint["lightning_scale"] = {"optimizer_param_names": names}
    return checkpoint


def _torch_optimizer_state(
    path: AnyPath, by_name: dict[str, dict[str, Tensor]], saved: Mapping[str, Any]
) -> dict[str, Any]:
    """``optimizer.state_dict()``'s form: parameters numbered across the groups in order, ``state`` by number."""
    names = [n for group in saved["param_names"] for n in group]
    index = {n: i for i, n in enumerate(names)}
    stray = sorted(set(by_name) - set(index))
    if stray or len(saved["param_names"]) != len(saved["param_groups"]):
        raise CheckpointCorruptError(
            f"{path / TRAINER_STATE}: the optimizer's parameter groups do not cover its state ({stray[:3]} have no group)."
        )
    numbers = saved.get("numbers") or {}
    state: dict[int, dict[str, Any]] = {}
    for name in sorted(by_name, key=index.__getitem__):
        entries: dict[str, Any] = dict(by_name[name])
        for key, value in entries.items():
            kind = numbers.get(f"{name}/{key}")
            if kind is not None:  # a Python number in the optimizer, a 0-d tensor in the shards
                entries[key] = int(value.item()) if kind == "int" else float(value.item())
        state[index[name]] = entries
    groups = [
        {**hyper, "params": [index[n] for n in group]}
        for hyper, group in zip(saved["param_groups"], saved["param_names"])
    ]
    return {"state": state, "param_groups": groups}


def hyper_parameters_of(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def flatten_template(template: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, tuple[type, Tensor]]]:
    """Flat keys of the template's tensors; ``numbers``: where the live value is a Python number, its
    type and the 0-d tensor that receives it."""
    flat: dict[str, Tensor] = {}
    numbers: dict[str, tuple[type, Tensor]] = {}
    for name, value in (template.get("state_dict") or {}).items():
        flat[f"{MODEL}/{name}"] = value
    for key, value in (template.get("strategy_state") or {}).items():
        flat[f"{STRATEGY}/{key}"] = value
    for i, state in enumerate(template.get("optimizer_states") or []):
        for fqn, entries in state.get("state", {}).items():
            for key, value in entries.items():
                flat_key = f"{OPTIM}/{i}/{fqn}/{key}"
                if isinstance(value, Tensor):
                    flat[flat_key] = value
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    box = torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)
                    numbers[flat_key] = (type(value), box)
                    flat[flat_key] = box
    return flat, numbers


def restored_optimizer(
    state: Mapping[str, Any],
    index: int,
    saved_groups: list[dict[str, Any]] | None,
    numbers: Mapping[str, tuple[type, Tensor]],
) -> dict[str, Any]:
    """The template's optimizer state (loaded in place) with the saved hyper-parameters per group."""
    restored: dict[str, Any] = {"state": {}, "param_groups": []}
    for fqn, entries in state.get("state", {}).items():
        out = {}
        for key, value in entries.items():
            number = numbers.get(f"{OPTIM}/{index}/{fqn}/{key}")
            out[key] = value if number is None else number[0](number[1].item())
        restored["state"][fqn] = out
    groups = list(state.get("param_groups", []))
    if saved_groups is not None and len(saved_groups) != len(groups):
        raise ValueError(
            f"Optimizer {index} has {len(groups)} parameter groups here and {len(saved_groups)} in the checkpoint: "
            "configure_optimizers must build the same groups to resume."
        )
    for i, group in enumerate(groups):
        restored["param_groups"].append(
            {**group, **(saved_groups[i] if saved_groups else {}), "params": group["params"]}
        )
    return restored


def unflatten_optimizer(loaded: Mapping[str, Tensor], index: int) -> dict[str, dict[str, Tensor]]:
    prefix = f"{OPTIM}/{index}/"
    state: dict[str, dict[str, Tensor]] = {}
    for key, value in loaded.items():
        if key.startswith(prefix):
            fqn, _, name = key[len(prefix) :].rpartition("/")
            state.setdefault(fqn, {})[name] = value
    return state


def json_bytes(doc: Any) -> bytes:
    """A checkpoint's JSON file: strict JSON (no NaN: :mod:`~lightning_scale.core.checkpoint.state` tags those)."""
    return json.dumps(doc, allow_nan=False).encode()


def versions(checkpoint: Mapping[str, Any]) -> dict[str, str]:
    """The package, torch and Lightning versions a manifest records."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("lightning-scale")
    except PackageNotFoundError:
        ours = "unknown"
    return {
        "lightning_scale": ours,
        "torch": torch.__version__,
        "lightning": str(checkpoint.get("pytorch-lightning_version", "")),
    }
