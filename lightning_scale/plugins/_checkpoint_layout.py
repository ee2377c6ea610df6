"""How a Lightning checkpoint dict maps onto a sharded checkpoint: flat DCP keys for every tensor
(``model/<fqn>``, ``optim/<i>/<fqn>/<state>``, ``extra/<json path>``) and the JSON of the rest, and back."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_scale.core.checkpoint_state import decode, encode
from lightning_scale.core.sharded_checkpoint import full_tensors_from
from lightning_scale.core.storage import AnyPath

__all__ = [
    "EXTRA",
    "MODEL",
    "OPTIM",
    "TRAINER_STATE",
    "flatten_template",
    "load_whole",
    "restored_optimizer",
    "split_checkpoint",
]

TRAINER_STATE = "trainer_state.json"
MODEL, OPTIM, EXTRA = "model", "optim", "extra"
_LENIENT = ("hyper_parameters", "datamodule_hyper_parameters")


def split_checkpoint(checkpoint: Mapping[str, Any], rank: int) -> tuple[dict[str, Tensor], Any]:
    """``(tensors, doc)``: every tensor of a Lightning checkpoint under a flat key, and the JSON of the rest
    (a plain tensor of that rest is kept from rank 0 only, as Lightning saves rank 0's state)."""
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
    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    if "optimizer_states" in checkpoint:
        rest["optimizer_states"] = optimizers
    extras: dict[str, Tensor] = {}
    doc = encode(rest, extras, prefix=EXTRA, lenient=lambda p: bool(p) and p[0] in _LENIENT)
    for key, value in extras.items():
        # Rank 0's state is the checkpoint's (as with Lightning's rank-0 save); a DTensor needs every rank's shard.
        if rank == 0 or isinstance(value, DTensor):
            tensors[key] = value
    return tensors, doc



def load_whole(path: AnyPath, manifest: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every tensor of the checkpoint whole, on the CPU, in the structure Lightning's checkpoints have.
    ``manifest``: hash the shard files as they are read (:func:`full_tensors_from`)."""
    loaded = full_tensors_from(path, manifest=manifest)
    checkpoint = decode(json.loads((path / TRAINER_STATE).read_text()), loaded)
    checkpoint["state_dict"] = state = {k[len(MODEL) + 1 :]: v for k, v in loaded.items() if k.startswith(f"{MODEL}/")}
    for names in json.loads((path / "manifest.json").read_text()).get("tied") or []:
        for alias in names[1:]:
            if names[0] in state:
                state[alias] = state[names[0]]  # one tensor under every name, as the module shares it
    for i, state in enumerate(checkpoint.get("optimizer_states") or []):
        state["state"] = unflatten_optimizer(loaded, i)
    return checkpoint


def hyper_parameters_of(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def flatten_template(template: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, tuple[type, Tensor]]]:
    """Flat keys of the template's tensors; ``numbers``: where the live value is a Python number, its
    type and the 0-d tensor that receives it."""
    flat: dict[str, Tensor] = {}
    numbers: dict[str, tuple[type, Tensor]] = {}
    for name, value in (template.get("state_dict") or {}).items():
        flat[f"{MODEL}/{name}"] = value
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
        restored["param_groups"].append({**group, **(saved_groups[i] if saved_groups else {}), "params": group["params"]})
    return restored


def unflatten_optimizer(loaded: Mapping[str, Tensor], index: int) -> dict[str, dict[str, Tensor]]:
    prefix = f"{OPTIM}/{index}/"
    state: dict[str, dict[str, Tensor]] = {}
    for key, value in loaded.items():
        if key.startswith(prefix):
            fqn, _, name = key[len(prefix) :].rpartition("/")
            state.setdefault(fqn, {})[name] = value
    return state
