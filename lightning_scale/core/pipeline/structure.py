"""Stage outputs that are not tensors: dicts, dataclasses, named tuples, Hugging Face ``ModelOutput``s.

torch's pipeline stages send and receive a tensor or a tuple of tensors. A model whose blocks pass a
dict (``{"hidden": h, "aux": a}``), a dataclass or a ``ModelOutput`` from one to the next is cut at
such a boundary all the same: the sending stage's output is flattened to its tensors, in order
(:class:`StructuredEdges`, hooks on the stage's module); at the first step it tells the receiving stage
the structure (:class:`DescriptionLink`), which rebuilds the value before its forward runs, so the
model's own code sees what it returned. The last stage's output is flattened the same way and rebuilt
before the loss sees it (on that rank, so no description travels).

The description names containers (``dict``, ``list``, ``tuple``) and, for dataclasses and named tuples,
the class as ``module:qualname``. Rebuilding only looks such a class up among modules already imported
(the model's own code is imported on every rank): nothing is imported or run because a peer named it.
Leaves that are not tensors (``None``, numbers, strings) travel inside the description as constants.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DescriptionLink", "StructuredEdges", "flatten", "gloo_group", "is_plain", "map_tensors", "rebuild"]

_CONSTANTS = (type(None), bool, int, float, str)
_TAG = 0x4C53  # the descriptions' messages, apart from the schedule's own on a shared gloo group


def is_plain(value: Any) -> bool:
    """Whether torch's stages take ``value`` as it is: a tensor, or a tuple or list of tensors."""
    if isinstance(value, torch.Tensor):
        return True
    return type(value) in (tuple, list) and bool(value) and all(isinstance(v, torch.Tensor) for v in value)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _lookup(name: str) -> type:
    """The class ``module:qualname`` among modules already imported; nothing is imported."""
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not isinstance(found, type):
        raise ValueError(
            f"A pipeline stage received a value of class {name!r}, which is not defined in any module this rank "
            "has imported; every rank must run the same model code."
        )
    return found


def _describe(value: Any, leaves: list[torch.Tensor], path: str) -> Any:
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return "T"
    if isinstance(value, _CONSTANTS):
        return {"c": value}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # A Hugging Face ModelOutput is a dataclass and a dict: its set fields are its items.
        fields = (
            list(value.keys()) if isinstance(value, Mapping) else [f.name for f in dataclasses.fields(value) if f.init]
        )
        children = [_describe(getattr(value, k), leaves, f"{path}.{k}") for k in fields]
        return {"dc": _class_name(type(value)), "k": fields, "v": children}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return {
            "nt": _class_name(type(value)),
            "v": [_describe(v, leaves, f"{path}.{k}") for k, v in zip(value._fields, value)],
        }
    if type(value) in (tuple, list):
        return {type(value).__name__: [_describe(v, leaves, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        keys = list(value)
        return {"dict": keys, "v": [_describe(value[k], leaves, f"{path}[{k!r}]") for k in keys]}
    raise TypeError(
        f"A pipeline stage's output holds {path} of type {type(value).__name__}, which cannot be sent to the next "
        "stage: stage outputs may be tensors, or tuples, lists, dicts with string keys, dataclasses, named tuples "
        "and Hugging Face ModelOutputs of tensors (None, numbers and strings travel as constants). Return the "
        "value as a tensor, or keep it out of what the block returns."
    )


def flatten(value: Any) -> tuple[list[torch.Tensor], Any]:
    """``(tensors, description)`` of ``value``; :func:`rebuild` inverts it."""
    leaves: list[torch.Tensor] = []
    return leaves, _describe(value, leaves, "output")


def _build(node: Any, leaves: list[torch.Tensor], position: list[int]) -> Any:
    if node == "T":
        position[0] += 1
        return leaves[position[0] - 1]
    if "c" in node:
        return node["c"]
    if "dc" in node:
        cls = _lookup(node["dc"])
        if not dataclasses.is_dataclass(cls):
            raise ValueError(
                f"A pipeline stage received {node['dc']!r} as a dataclass, but it is not one on this rank."
            )
        values = [_build(v, leaves, position) for v in node["v"]]
        return cls(**dict(zip(node["k"], values, strict=True)))
    if "nt" in node:
        cls = _lookup(node["nt"])
        return cls(*(_build(v, leaves, position) for v in node["v"]))
    if "dict" in node:
        return {k: _build(v, leaves, position) for k, v in zip(node["dict"], node["v"], strict=True)}
    kind = "tuple" if "tuple" in node else "list"
    items = [_build(v, leaves, position) for v in node[kind]]
    return tuple(items) if kind == "tuple" else items


def map_tensors(value: Any, fn: Any) -> Any:
    """``value`` with ``fn`` applied to each of its tensors (the structures :func:`flatten` takes)."""
    leaves, description = flatten(value)
    return rebuild([fn(t) for t in leaves], description)


def rebuild(leaves: Any, description: Any) -> Any:
    """The value :func:`flatten` described, from its tensors (in order)."""
    position = [0]
    value = _build(description, list(leaves), position)
    if position[0] != len(leaves):
        raise ValueError(f"A pipeline stage received {len(leaves)} tensors for a structure of {position[0]}.")
    return value


class DescriptionLink:
    """How each stage tells the next one the structure of what it sends: once, at the first forward.

    Every stage but the last sends one description (``None`` for a tensor or a tuple of tensors) and
    every stage but the first receives one, in forward order, over a gloo group of the pipeline's ranks
    under a tag of its own (its messages never match the schedule's). Consecutive stages on one rank
    (V-shaped schedules) hand it over in memory.

    Args:
        stage_ranks: the global rank of each stage.
        group: a gloo group of the pipeline's ranks (:func:`gloo_group`), held weakly: the process
            groups' end (``core.parallel.process_groups.end_process_groups``) must be able to join its threads.
    """

    def __init__(self, stage_ranks: list[int], group: Any) -> None:
        self.stage_ranks, self._group = stage_ranks, weakref.ref(group)
        self.rank = dist.get_rank()
        self._local: dict[int, Any] = {}
        self._pending: list[tuple[Any, torch.Tensor]] = []

    def group(self) -> Any:
        group = self._group()
        if group is None:
            raise RuntimeError("The pipeline's process groups were destroyed; its stages can no longer communicate.")
        return group

    def send(self, stage: int, description: Any) -> None:
        dst = self.stage_ranks[stage + 1]
        if dst == self.rank:
            self._local[stage + 1] = description
            return
        data = torch.tensor(list(json.dumps(description, separators=(",", ":")).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        # Not blocking: the receiver takes it in its forward, after the schedule's own first message.
        self._pending += [(dist.isend(t, dst, group=self.group(), tag=_TAG), t) for t in (size, data)]

    def wait(self) -> None:
        """Every description this rank sent has been received (the step that sent them is over)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    def recv(self, stage: int) -> Any:
        src = self.stage_ranks[stage - 1]
        if src == self.rank:
            return self._local.pop(stage)
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src, group=self.group(), tag=_TAG)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, src, group=self.group(), tag=_TAG)
        return json.loads(bytes(data.tolist()))


def gloo_group(mesh: Any) -> Any:
    """The group of this rank's pipeline (``mesh["pp"]``) when it is gloo, else a gloo group of the same
    ranks (collective over the mesh: every pipeline's group is created on every rank)."""
    group = mesh["pp"].get_group()
    if dist.get_backend(group) == "gloo":
        return group
    dim = list(mesh.mesh_dim_names).index("pp")
    members = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.mesh.size(dim)).tolist()
    mine, _ = dist.new_subgroups_by_enumeration(members, backend="gloo")
    return mine  # registered with the world (destroy_process_group ends it); the link holds it weakly


class StructuredEdges:
    """Hooks on a stage's module that flatten a structured output into its tensors and rebuild a
    structured input from them (active only while the pipeline's schedule runs: :attr:`active`).

    The output hook runs before any other (FSDP2's sees the tensors); the input hook after the others
    (FSDP2 casts the tensors it receives, then the model gets the value it returned). The last stage
    keeps its output's description for :meth:`rebuild_output`.
    """

    def __init__(self, link: DescriptionLink, num_stages: int) -> None:
        self.link, self.num_stages = link, num_stages
        self.active = False
        self._received: dict[int, Any] = {}
        self._sent: dict[int, Any] = {}
        self._handles: list[Any] = []
        self.output_description: Any = None

    def attach(self, modules: list[nn.Module], stages: list[int]) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module, stage in zip(modules, stages, strict=True):
            if stage > 0:
                self._handles.append(module.register_forward_pre_hook(self._inputs_hook(stage), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._output_hook(stage), prepend=True))

    def _inputs_hook(self, stage: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not self.active:
                return None
            if stage not in self._received:
                self._received[stage] = self.link.recv(stage)
            description = self._received[stage]
            return None if description is None else ((rebuild(args, description),), kwargs)

        return hook

    def _output_hook(self, stage: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if not self.active:
                return None
            plain = is_plain(output)
            leaves, description = ([], None) if plain else flatten(output)
            if not plain and not leaves:
                raise TypeError(
                    f"Pipeline stage {stage}'s output ({type(output).__name__}) holds no tensor; the next stage "
                    "needs its activations."
                )
            if stage == self.num_stages - 1:
                self.output_description = description
            elif stage not in self._sent:
                self._sent[stage] = description
                self.link.send(stage, description)
            elif self._sent[stage] != description:
                raise TypeError(
                    f"Pipeline stage {stage} returned a value of another structure than at its first step "
                    f"({description} after {self._sent[stage]}); stages must return the same structure every step."
                )
            return None if plain else tuple(leaves)

        return hook

    def rebuild_output(self, output: Any) -> Any:
        """The last stage's output as the model returned it (``output``: what the stage gave torch)."""
        if self.output_description is None:
            return output
        return rebuild(output if isinstance(output, (tuple, list)) else (output,), self.output_description)
