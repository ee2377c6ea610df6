"""Deferred initialisation: a model built on the meta device is cut and sharded first, and only
then does each rank allocate and initialise its own part, the same values at every layout.

The contract (what a model must offer, and the order things happen in):

1. **Plan, on the whole model, before it is cut.** Every tensor on the meta device has an *owner*:
   the first module, in ``named_modules()`` order, that holds it as its own parameter or buffer (a
   weight tied between an embedding and a head is owned by the embedding, on every stage). Each
   owner's initialiser is the first of:

   - ``_init_weights(module)`` of the nearest enclosing module that defines it (the module itself,
     its parents, ... up to the LightningModule): a model-level, per-module hook. Hugging Face's
     ``PreTrainedModel._init_weights`` is one; the reference GPT defines its scheme this way;
   - the module's own ``reset_parameters()`` (torch's layers, Lightning's convention);

   and a meta tensor whose owner has neither is refused here, before any work.
2. **Cut and shard** on the meta device (pipeline stage, tensor parallel, FSDP2): no memory.
3. **Allocate** this rank's tensors, uninitialised, on its device (``Module._apply``; FSDP2 re-adopts
   its sharded parameters, ties are restored).
4. **Initialise, one owner at a time**, for the owners of the tensors this rank holds, in plan
   order: the owner's own tensors are created whole on the host (CPU), filled with NaN; torch's
   CPU generator is seeded from ``(seed, owner's name)``; the initialiser runs; every floating
   tensor must then be finite (a NaN left means the initialiser skipped it: refused, naming it);
   this rank's shard of each tensor it holds is copied into place (DTensor placements, whatever
   they are) and the whole tensors are freed.

So a rank holds, at most, its own shard plus one module's whole tensors, and since every value
depends only on the seed and the names (which no layout changes), the same seed gives the same
full parameters at every (dp, tp, pp). The global random state is left as it was.
Tensors that are not on the meta device are never touched (an initialiser runs on copies of them).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_scale.core.compat import apply_to_tensors, module_buffers, module_parameters

__all__ = ["DeferredInit", "has_meta_tensors", "module_seed"]

INIT_HOOK = "_init_weights"


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def module_seed(seed: int, name: str) -> int:
    """The generator seed for the module called ``name`` (stable across processes and Python runs)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _own(module: nn.Module) -> Iterator[tuple[str, Tensor, bool]]:
    """``(attr, tensor, is_parameter)`` for the module's own parameters and buffers."""
    for attr, tensor in module_parameters(module).items():
        if tensor is not None:
            yield attr, tensor, True
    for attr, tensor in module_buffers(module).items():
        if tensor is not None:
            yield attr, tensor, False


@dataclass
class _Owner:
    name: str
    module: nn.Module
    init: Callable[[], object]
    how: str
    # attr -> (shape, dtype, is_parameter, requires_grad) of each meta tensor it owns
    meta: dict[str, tuple[torch.Size, torch.dtype, bool, bool]] = field(default_factory=dict)


def _initialiser(root: nn.Module, name: str, module: nn.Module) -> tuple[Callable[[], object], str] | None:
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        ancestor_name = ".".join(parts[:depth])
        ancestor = root.get_submodule(ancestor_name) if ancestor_name else root
        hook = getattr(ancestor, INIT_HOOK, None)
        if callable(hook):
            return partial(hook, module), f"{type(ancestor).__name__}.{INIT_HOOK}({type(module).__name__})"
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset, f"{type(module).__name__}.reset_parameters()"
    return None


class DeferredInit:
    """Who initialises each meta tensor of ``root`` (found on the whole model; see the module docstring).

    Build it with :meth:`plan` before the model is cut, then call :meth:`materialize` on the cut
    (and sharded) model with the same root.
    """

    def __init__(self, owners: dict[str, _Owner], owner_of: dict[str, tuple[str, str]]) -> None:
        self._owners = owners
        self._owner_of = owner_of  # tensor name (every alias) -> (owner name, attr)

    @classmethod
    def plan(cls, root: nn.Module) -> DeferredInit | None:
        """None when nothing in ``root`` is on the meta device. Raises ``ValueError`` for a meta
        tensor nobody can initialise."""
        owners: dict[str, _Owner] = {}
        owner_of: dict[str, tuple[str, str]] = {}
        first: dict[int, tuple[str, str]] = {}
        uninitialisable: list[str] = []
        for name, module in root.named_modules(remove_duplicate=False):
            for attr, tensor, is_param in _own(module):
                if not tensor.is_meta:
                    continue
                full = f"{name}.{attr}" if name else attr
                if id(tensor) in first:
                    owner_of[full] = first[id(tensor)]
                    continue
                first[id(tensor)] = owner_of[full] = (name, attr)
                if name not in owners:
                    found = _initialiser(root, name, module)
                    if found is None:
                        uninitialisable.append(f"{full} ({type(module).__name__})")
                        continue
                    owners[name] = _Owner(name, module, *found)
                owners[name].meta[attr] = (tensor.shape, tensor.dtype, is_param, tensor.requires_grad)
        if uninitialisable:
            raise ValueError(
                f"{len(uninitialisable)} tensors were created on the meta device but nothing can initialise them: "
                f"{uninitialisable[:5]}. Each module holding meta tensors needs `reset_parameters()`, or an enclosing "
                f"module (the model or the LightningModule) needs `{INIT_HOOK}(self, module)` that initialises it; "
                "or create that module on a real device."
            )
        return cls(owners, owner_of) if owner_of else None

    @property
    def num_tensors(self) -> int:
        return len(set(self._owner_of.values()))

    def materialize(
        self, root: nn.Module, device: torch.device, seed: int, extra_roots: Iterable[nn.Module] = ()
    ) -> list[str]:
        """Allocate and initialise this rank's part of the (cut, sharded) ``root`` on ``device``.

        ``extra_roots``: modules outside ``root``'s tree that share its tensors (a pipeline rank's
        stage views, which FSDP2 may wrap). Returns the problems found (a tensor the initialiser left
        non-finite); every rank should compare notes before going on.
        """
        _allocate(root, device, extra_roots)
        # owner name -> (module, attr, tensor, the owner's attr) of each tensor this rank holds
        held: dict[str, list[tuple[nn.Module, str, Tensor, str]]] = {}
        for name, module in root.named_modules(remove_duplicate=False):
            for attr, tensor, _ in _own(module):
                key = self._owner_of.get(f"{name}.{attr}" if name else attr)
                if key is not None:
                    held.setdefault(key[0], []).append((module, attr, tensor, key[1]))
        problems: list[str] = []
        for owner in self._owners.values():
            if owner.name not in held:
                continue  # another stage's
            values, bad = self._initialised(owner, seed)
            problems += bad
            for module, attr, tensor, owner_attr in held[owner.name]:
                if owner_attr in values:
                    _write(module, attr, tensor, values[owner_attr])
            del values
        return problems

    def _initialised(self, owner: _Owner, seed: int) -> tuple[dict[str, Tensor], list[str]]:
        """The owner's meta tensors, whole on the host, as its initialiser leaves them."""
        module = owner.module
        params, buffers = module_parameters(module), module_buffers(module)
        saved_params, saved_buffers = dict(params), dict(buffers)
        try:
            for attr, tensor, is_param in _own(module):
                if attr in owner.meta:
                    shape, dtype, _, requires_grad = owner.meta[attr]
                    host = torch.empty(shape, dtype=dtype, device="cpu")
                    if host.is_floating_point() or host.is_complex():
                        host.fill_(float("nan"))
                else:
                    host, requires_grad = tensor.detach().clone(), tensor.requires_grad  # never changes the real one
                if is_param:
                    params[attr] = nn.Parameter(host, requires_grad=requires_grad)
                else:
                    buffers[attr] = host
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.default_generator.manual_seed(module_seed(seed, owner.name))
                owner.init()
            values = {attr: (params.get(attr) if owner.meta[attr][2] else buffers.get(attr)) for attr in owner.meta}
        finally:
            params.clear()
            params.update(saved_params)
            buffers.clear()
            buffers.update(saved_buffers)
        problems = []
        for attr, value in values.items():
            label = f"{owner.name}.{attr}" if owner.name else attr
            if value is None or value.is_meta:
                problems.append(f"{label}: {owner.how} left it unset")
            elif (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
                problems.append(f"{label}: {owner.how} left non-finite values (it does not initialise this tensor)")
        return {a: v.detach() for a, v in values.items() if v is not None}, problems


def _allocate(root: nn.Module, device: torch.device, extra_roots: Iterable[nn.Module]) -> None:
    """Uninitialised storage for every meta tensor (DTensors get their local shard), ties kept."""
    groups: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for _, module in root.named_modules(remove_duplicate=False):
        for attr, tensor, is_param in _own(module):
            groups.setdefault(id(tensor), []).append((module, attr, is_param))

    def empty(t: Tensor) -> Tensor:
        return torch.empty_like(t, device=device) if t.is_meta else t

    apply_to_tensors(root, empty)
    for extra in extra_roots:
        apply_to_tensors(extra, empty)  # FSDP2 units outside the tree re-adopt their sharded parameters
    # `_apply` gives each module a new tensor for a meta one, untying weights shared by modules.
    for members in groups.values():
        (module, attr, is_param), *others = members
        tensor = (module_parameters(module) if is_param else module_buffers(module))[attr]
        for other, other_attr, other_is_param in others:
            (module_parameters(other) if other_is_param else module_buffers(other))[other_attr] = tensor


def _write(module: nn.Module, attr: str, tensor: Tensor, value: Tensor) -> None:
    """Put this rank's part of the whole ``value`` into ``tensor`` (``module``'s ``attr``)."""
    with torch.no_grad():
        if isinstance(tensor, DTensor):
            # Every rank holds the whole value: no communication, each keeps its own shard.
            local = distribute_tensor(value, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
            tensor.to_local().copy_(local)
        elif attr in module_parameters(module):
            tensor.copy_(value)
        else:
            # A buffer may change shape in its initialiser (a table computed from the config).
            module_buffers(module)[attr] = value.to(
                device=tensor.device, dtype=tensor.dtype if value.is_floating_point() else value.dtype
            )
