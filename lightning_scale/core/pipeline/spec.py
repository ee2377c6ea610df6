"""What a model declares so it can be cut into pipeline stages, and how a stage is cut.

A stage is the original model with the other stages' blocks (and, off the first and last stage,
the modules before and after the blocks) removed. Nothing is renamed, so ``blocks.7.attn.wq.weight``
is called that at every pipeline size and a checkpoint saved at one layout loads at any other.
Blocks may sit in an ``nn.ModuleDict``, an ``nn.Sequential`` or an ``nn.ModuleList`` (which becomes
a :class:`KeptModuleList`: iterating it yields the stage's blocks, their names unchanged).
The model's ``forward`` must skip what is missing (a removed embedding means the input already is
the hidden state; a removed head means the output is the hidden state), as the reference GPT's does.
Parameters outside every declared module (set directly on the root, like a ViT's ``cls_token``) stay
on every stage; the runner keeps the copies in step, as it does weights tied across stages.
"""

from __future__ import annotations

import copy
import linecache
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from lightning_scale.core.compat import module_buffers, module_children, module_parameters
from lightning_scale.core.parallel.modules import Matcher, check_matcher, outermost_registered

__all__ = [
    "IGNORE_INDEX",
    "KeptModuleList",
    "PipelineSpec",
    "StageForward",
    "find_registered_spec",
    "labelled_tokens",
    "prune_to_stage",
    "register_pipeline_spec",
    "removed_module_called",
    "removed_modules",
    "stage_view",
    "undeclared_buffers",
    "undeclared_parameters",
    "with_registered_forward",
]

IGNORE_INDEX = -100
"""The target value that torch's ``cross_entropy``/``nll_loss`` (and transformers) leave out of the mean."""


def labelled_tokens(target: torch.Tensor) -> torch.Tensor:
    """How many positions of ``target`` a cross entropy with the default ``ignore_index`` averages over."""
    return (target != IGNORE_INDEX).sum()


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
        stage_forward: ``stage_forward(module, *inputs, **kwargs) -> output``: how a stage runs its
            pruned module (default: ``module(*inputs, **kwargs)``); the first stage's inputs are the
            batch inputs, a later stage's the hidden state; ``kwargs`` are the batch's extra inputs
            (``position_ids``, ...), which every stage receives.
        split_batch: ``split_batch(batch) -> (inputs, target)`` or ``(inputs, target, kwargs)`` for
            batches of the kind this model is usually fed (a Hugging Face ``{"input_ids", "labels"}``
            dict), used when the LightningModule defines no ``pipeline_batch`` hook.
        loss_tokens: ``loss_tokens(target) -> count``: how many positions ``loss_fn`` averages over in
            ``target`` (:func:`labelled_tokens`: the positions not equal to -100). Each micro-batch's
            loss then counts by its share of the batch's positions (the sum over micro-batches divided
            once by the batch's count): what ``loss_fn`` gives on the whole batch, however the ignored
            positions fall. Without it micro-batches count equally, which is exact for a loss averaged
            over every position; an integer target holding -100 is then refused.
    """

    blocks: Sequence[str]
    first: Sequence[str] = ()
    last: Sequence[str] = ()
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    identity: Sequence[str] = ()
    stage_forward: Callable[..., Any] | None = field(default=None, compare=False)
    split_batch: Callable[[Any], tuple[Any, ...]] | None = field(default=None, compare=False)
    loss_tokens: Callable[[Any], torch.Tensor | int] | None = field(default=None, compare=False)

    def declared(self) -> list[str]:
        """Every module the spec places: blocks, ``first`` and ``last``."""
        return [*self.blocks, *self.first, *self.last]

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("A PipelineSpec needs at least one block to cut between.")
        names = self.declared()
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
        kept = list(module_children(self).values())
        if isinstance(idx, slice):
            return nn.ModuleList(kept[idx])
        return kept[idx]  # type: ignore[return-value]

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        children = module_children(self)
        children[list(children)[idx]] = module

    def __delitem__(self, idx: int | slice) -> None:
        children = module_children(self)
        for key in list(children)[idx] if isinstance(idx, slice) else [list(children)[idx]]:
            del children[key]

    def _grow(self, *args: object, **kwargs: object) -> KeptModuleList:
        raise TypeError(
            "A pipeline stage's module list holds only its own layers, under their original indices; adding one "
            "would reuse a name. Build the model whole before it is cut into stages."
        )

    append = insert = extend = __iadd__ = _grow  # type: ignore[assignment]


def with_registered_forward(root: nn.Module, spec: PipelineSpec) -> PipelineSpec:
    """``spec`` (a user's cut of ``root``) completed with how the registered architecture that ``root``
    itself is runs a stage: its ``stage_forward`` and ``identity`` modules when ``spec`` gives no
    ``stage_forward``, and its loss, token count and batch split when ``spec`` gives no ``loss_fn``.

    A user cutting a Hugging Face decoder their own way still needs the family's forward (a later
    stage feeds the hidden state as ``inputs_embeds``; the final norm is an identity off the last
    stage), or the model's own ``forward`` calls a module the cut removed.
    """
    found = find_registered_spec(root)
    if found is None or found[0] != "" or spec.stage_forward is not None:
        return spec
    registered = found[1]
    placed = {*spec.first, *spec.last}
    changes: dict[str, Any] = {
        "stage_forward": registered.stage_forward,
        "identity": sorted({*spec.identity, *(n for n in registered.identity if n in placed)}),
    }
    if spec.loss_fn is None:
        changes |= {
            "loss_fn": registered.loss_fn,
            "loss_tokens": registered.loss_tokens,
            "split_batch": spec.split_batch or registered.split_batch,
        }
    return replace(spec, **changes)


def undeclared_parameters(root: nn.Module, spec: PipelineSpec) -> list[str]:
    """Names of ``root``'s parameters outside every module the spec places (parameters set directly
    on ``root``, like a ViT's ``cls_token``, or in a module it does not list): every stage keeps them."""
    return _undeclared((n for n, _ in root.named_parameters()), spec)


def undeclared_buffers(root: nn.Module, spec: PipelineSpec) -> list[str]:
    """Names of ``root``'s buffers outside every module the spec places: every stage keeps a copy."""
    return _undeclared((n for n, _ in root.named_buffers()), spec)


def _undeclared(names: Iterable[str], spec: PipelineSpec) -> list[str]:
    declared = spec.declared()
    return [name for name in names if not any(name.startswith(module + ".") for module in declared)]


def _remove(root: nn.Module, name: str, identity: bool = False) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    if isinstance(parent, (nn.ModuleDict, nn.ModuleList, nn.Sequential)):
        # Not `del parent[i]`: ModuleList and Sequential renumber the entries after it.
        del module_children(parent)[attr]
        if type(parent) is nn.ModuleList:
            parent.__class__ = KeptModuleList
    else:
        setattr(parent, attr, nn.Identity() if identity else None)


def removed_modules(spec: PipelineSpec, keep: Sequence[int], is_first: bool, is_last: bool) -> list[str]:
    keep_set = set(keep)
    drop: list[str] = [name for i, name in enumerate(spec.blocks) if i not in keep_set]
    if not is_first:
        drop += list(spec.first)
    if not is_last:
        drop += list(spec.last)
    return drop


def removed_module_called(
    error: BaseException | None, root: nn.Module, spec: PipelineSpec, removed: Sequence[str]
) -> str | None:
    """The message for a stage's forward that called a module its stage does not hold (``None`` when
    ``error`` is something else): which module, on which line, and the ways out.

    A removed ``first``/``last`` module is ``None`` on the stages without it, so a forward that calls
    it unconditionally fails with ``'NoneType' object is not callable`` deep inside the model.
    """
    if not (isinstance(error, TypeError) and "'NoneType' object is not callable" in str(error)):
        return None
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    line, owner = "", None
    if tb is not None:
        line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).strip()
        owner = tb.tb_frame.f_locals.get("self")
    owner_path = next((name for name, m in root.named_modules() if m is owner), None)
    candidates = [n for n in removed if n in (*spec.first, *spec.last)]
    called = [
        name
        for name in candidates
        if (owner_path is None or name.rpartition(".")[0] == owner_path)
        and re.search(rf"\b{re.escape(name.rpartition('.')[2])}\b", line)
    ]
    return (
        f"A pipeline stage's forward called {called or candidates} (`{line}`), which the pipeline spec removes "
        "from this stage (each of its first and last modules lives on the first or last stage only). Make the "
        "model's forward skip it when it is None, list it in the spec's identity=[...] (replaced by nn.Identity "
        "where it is removed), or give the spec a stage_forward(module, *inputs, **kwargs) that runs a stage."
    )


def prune_to_stage(
    root: nn.Module, spec: PipelineSpec, keep: Sequence[int], *, is_first: bool, is_last: bool
) -> nn.Module:
    """Remove, in place, every block not in ``keep`` (indices into ``spec.blocks``), and the ``first``
    modules unless ``is_first`` and the ``last`` modules unless ``is_last``. Returns ``root``."""
    names = {n for n, _ in root.named_modules()}
    missing = [n for n in [*spec.blocks, *spec.first, *spec.last] if n not in names]
    if missing:
        raise ValueError(f"The pipeline spec names modules that do not exist: {missing[:5]}")
    for name in removed_modules(spec, keep, is_first, is_last):
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
    drop = [n for n in removed_modules(spec, keep, is_first, is_last) if n in present]
    copies: dict[str, nn.Module] = {}

    def copied(path: str) -> nn.Module:
        if path not in copies:
            original = root.get_submodule(path) if path else root
            clone = copy.copy(original)
            # Its own table of children and of hooks (data parallelism hooks each view separately);
            # children, parameters and buffers stay shared.
            shared = (module_parameters(original), module_buffers(original))
            for attr, value in vars(original).items():
                if isinstance(value, dict) and not any(value is table for table in shared):
                    clone.__dict__[attr] = copy.copy(value)
            if path:
                parent_path, _, attr = path.rpartition(".")
                module_children(copied(parent_path))[attr] = clone
            copies[path] = clone
        return copies[path]

    for name in drop:
        parent_path, _, _ = name.rpartition(".")
        parent = copied(parent_path)
        # Only the copied parent's table changes; `root` keeps the module.
        _remove(parent, name.rpartition(".")[2], identity=name in spec.identity)
    return copied("")


class StageForward(nn.Module):
    """The module a pipeline stage runs when the spec has a ``stage_forward``: ``stage_forward(module, *inputs, **kwargs)``.

    The pruned model (or its view) is a child, so data parallelism wrapping this wrapper manages
    the model's parameters, and their names inside the model do not change.
    """

    def __init__(self, module: nn.Module, stage_forward: Callable[..., Any]) -> None:
        super().__init__()
        self.module = module
        self._stage_forward = stage_forward

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self._stage_forward(self.module, *inputs, **kwargs)
