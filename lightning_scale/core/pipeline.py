"""What a model declares so it can be cut into pipeline stages, and how a stage is cut.

A stage is the original model with the other stages' blocks (and, off the first and last stage,
the modules before and after the blocks) removed. Nothing is renamed, so ``blocks.7.attn.wq.weight``
is called that at every pipeline size and a checkpoint saved at one layout loads at any other.
Blocks may sit in an ``nn.ModuleDict``, an ``nn.Sequential`` or an ``nn.ModuleList`` (which becomes
a :class:`KeptModuleList`: iterating it yields the stage's blocks, their names unchanged).
The model's ``forward`` must skip what is missing (a removed embedding means the input already is
the hidden state; a removed head means the output is the hidden state), as the reference GPT's does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_scale.core.modules import Matcher, check_matcher, outermost_registered

__all__ = [
    "KeptModuleList",
    "PipelineSpec",
    "StageForward",
    "find_registered_spec",
    "prune_to_stage",
    "register_pipeline_spec",
    "stage_view",
]


@dataclass(frozen=True)
class PipelineSpec:
    """How a model may be cut.

    Attributes:
        blocks: names of the blocks, in forward order; cuts fall between them.
        first: modules that run before the first block (they live on the first stage).
        last: modules that run after the last block (they live on the last stage).
        loss_fn: ``loss_fn(output, target) -> scalar``, computed on the last stage from the
            model's output and the batch target.
        identity: modules of ``first``/``last`` that a stage without them replaces by ``nn.Identity``
            instead of ``None`` (for models whose forward calls them unconditionally, like a final
            norm inside a Hugging Face base model).
        stage_forward: ``stage_forward(module, *inputs) -> output``: how a stage runs its pruned
            module (default: ``module(*inputs)``); the first stage's inputs are the batch inputs,
            a later stage's the hidden state.
        split_batch: ``split_batch(batch) -> (inputs, target)`` for batches of the kind this model is
            usually fed (a Hugging Face ``{"input_ids", "labels"}`` dict), used when the
            LightningModule defines no ``pipeline_batch`` hook.
    """

    blocks: Sequence[str]
    first: Sequence[str] = ()
    last: Sequence[str] = ()
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    identity: Sequence[str] = ()
    stage_forward: Callable[..., Any] | None = field(default=None, compare=False)
    split_batch: Callable[[Any], tuple[Any, Any]] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("A PipelineSpec needs at least one block to cut between.")
        names = [*self.blocks, *self.first, *self.last]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"PipelineSpec names {dupes} more than once; each module belongs to one place.")
        stray = sorted(set(self.identity) - set(self.first) - set(self.last))
        if stray:
            raise ValueError(f"PipelineSpec identity {stray} must be among its first or last modules.")


SpecFn = Callable[[nn.Module], PipelineSpec]
_REGISTRY: dict[Matcher, SpecFn] = {}


def register_pipeline_spec(matcher: Matcher, spec_fn: SpecFn) -> None:
    """Register how an architecture is cut; applies to every instance found inside a model.

    ``matcher``: an ``nn.Module`` subclass, or a predicate on module instances (tried after the
    types, in registration order)."""
    check_matcher("register_pipeline_spec", matcher)
    _REGISTRY[matcher] = spec_fn


def find_registered_spec(root: nn.Module) -> tuple[str, PipelineSpec] | None:
    """``(name, spec)`` of the outermost registered module inside ``root``: ``name`` is its path in
    ``root`` (``""`` for ``root`` itself) and the spec's names are relative to it.

    Raises ``ValueError`` when two registered modules sit side by side (which one to cut is ambiguous).
    """
    found = [(name, spec_fn(module)) for name, module, spec_fn in outermost_registered(root, _REGISTRY)]
    if len(found) > 1:
        raise ValueError(
            f"{type(root).__name__} contains several pipelined architectures ({[n for n, _ in found]}); "
            "declare which blocks to cut with a pipeline_spec hook."
        )
    return found[0] if found else None


class KeptModuleList(nn.ModuleList):
    """An ``nn.ModuleList`` that a pipeline stage removed entries from, keeping the others' names.

    ``nn.ModuleList`` renumbers its entries when one is deleted (``layers.5`` would become
    ``layers.1`` on a later stage, and checkpoints would depend on the layout). Here the kept entries
    keep their original keys (so parameter names stay ``layers.5.…``), while iteration, ``len`` and
    indexing are over the kept entries, in order: a model's ``for layer in self.layers`` or
    ``self.layers[: n]`` runs exactly this stage's layers. It cannot grow (that would reuse a name).
    A list becomes one by a class change, the way FSDP2 wraps modules: no state is added.
    """

    def __getitem__(self, idx: int | slice) -> nn.Module | nn.ModuleList:  # type: ignore[override]
        kept = list(self._modules.values())
        if isinstance(idx, slice):
            return nn.ModuleList(kept[idx])
        return kept[idx]  # type: ignore[return-value]

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        key = list(self._modules)[idx]
        self._modules[key] = module

    def __delitem__(self, idx: int | slice) -> None:
        for key in list(self._modules)[idx] if isinstance(idx, slice) else [list(self._modules)[idx]]:
            del self._modules[key]

    def _grow(self, *args: object, **kwargs: object) -> KeptModuleList:
        raise TypeError(
            "A pipeline stage's module list holds only its own layers, under their original indices; adding one "
            "would reuse a name. Build the model whole before it is cut into stages."
        )

    append = insert = extend = __iadd__ = _grow  # type: ignore[assignment]


def _remove(root: nn.Module, name: str, identity: bool = False) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    if isinstance(parent, (nn.ModuleDict, nn.ModuleList, nn.Sequential)):
        # Not `del parent[i]`: ModuleList and Sequential renumber the entries after it.
        del parent._modules[attr]
        if type(parent) is nn.ModuleList:
            parent.__class__ = KeptModuleList
    else:
        setattr(parent, attr, nn.Identity() if identity else None)


def _dropped(spec: PipelineSpec, keep: Sequence[int], is_first: bool, is_last: bool) -> list[str]:
    keep_set = set(keep)
    drop: list[str] = [name for i, name in enumerate(spec.blocks) if i not in keep_set]
    if not is_first:
        drop += list(spec.first)
    if not is_last:
        drop += list(spec.last)
    return drop


def prune_to_stage(root: nn.Module, spec: PipelineSpec, keep: Sequence[int], *, is_first: bool, is_last: bool) -> nn.Module:
    """Remove, in place, every block not in ``keep`` (indices into ``spec.blocks``), and the ``first``
    modules unless ``is_first`` and the ``last`` modules unless ``is_last``. Returns ``root``."""
    names = {n for n, _ in root.named_modules()}
    missing = [n for n in [*spec.blocks, *spec.first, *spec.last] if n not in names]
    if missing:
        raise ValueError(f"The pipeline spec names modules that do not exist: {missing[:5]}")
    for name in _dropped(spec, keep, is_first, is_last):
        _remove(root, name, identity=name in spec.identity)
    return root


def stage_view(root: nn.Module, spec: PipelineSpec, keep: Sequence[int], *, is_first: bool, is_last: bool) -> nn.Module:
    """A module that runs only blocks ``keep`` (and ``first``/``last`` as flagged), sharing every
    parameter, buffer, submodule and hook with ``root``, which is left unchanged.

    For a rank that runs several pipeline stages (interleaved and V-shaped schedules): ``root`` holds
    all of the rank's blocks (so its state dict, optimizer and checkpoints see them under their
    original names) and each stage runs through its own view. Only the modules on the path from
    ``root`` to a removed module are copied (shallowly, with their own tables of children and
    hooks); hooks registered on ``root`` before the views are made apply to them too.
    """
    present = {n for n, _ in root.named_modules()}
    drop = [n for n in _dropped(spec, keep, is_first, is_last) if n in present]
    copies: dict[str, nn.Module] = {}

    def copied(path: str) -> nn.Module:
        if path not in copies:
            original = root.get_submodule(path) if path else root
            clone = copy.copy(original)
            # Its own table of children and of hooks (data parallelism hooks each view separately);
            # children, parameters and buffers stay shared.
            for attr, value in vars(original).items():
                if isinstance(value, dict) and attr not in ("_parameters", "_buffers"):
                    clone.__dict__[attr] = copy.copy(value)
            if path:
                parent_path, _, attr = path.rpartition(".")
                copied(parent_path)._modules[attr] = clone
            copies[path] = clone
        return copies[path]

    for name in drop:
        parent_path, _, _ = name.rpartition(".")
        parent = copied(parent_path)
        # Only the copied parent's table changes; `root` keeps the module.
        _remove(parent, name.rpartition(".")[2], identity=name in spec.identity)
    return copied("")


class StageForward(nn.Module):
    """The module a pipeline stage runs when the spec has a ``stage_forward``: ``stage_forward(module, *inputs)``.

    The pruned model (or its view) is a child, so data parallelism wrapping this wrapper manages
    the model's parameters, and their names inside the model do not change.
    """

    def __init__(self, module: nn.Module, stage_forward: Callable[..., Any]) -> None:
        super().__init__()
        self.module = module
        self._stage_forward = stage_forward

    def forward(self, *inputs: Any) -> Any:
        return self._stage_forward(self.module, *inputs)
