"""Tensor-parallel plans: module-name patterns mapped to DTensor parallel styles, checked and applied.

A plan reads like a table (torchtitan's habit)::

    {
        "blocks.*.attn.wq": "colwise",          # a style name, or
        "blocks.*.attn.wo": RowwiseParallel(),  # a torch ParallelStyle instance
    }

``*`` matches one dotted segment of a module name (``blocks.*.mlp`` matches ``blocks.3.mlp``,
not ``blocks.3.mlp.fc``). Every key must match at least one module. The styles are torch's own
(``torch.distributed.tensor.parallel``); nothing here is a home-made parallel layer.

Plans for known architectures are registered by module type (:func:`register_plan`); a model
that is not registered supplies its plan through its LightningModule (see the strategy).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_scale.core.checks import format_choices
from lightning_scale.core.parallel.modules import Matcher, check_matcher, outermost_registered, tied_parameter_groups

__all__ = [
    "STYLE_NAMES",
    "PlanFn",
    "apply_tensor_parallel",
    "find_registered_plans",
    "full_state_dict",
    "register_plan",
    "resolve_plan",
]

STYLE_NAMES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "sequence_parallel": SequenceParallel,
}
"""Style names a plan may use instead of instances, with their default arguments."""

PlanFn = Callable[..., Mapping[str, ParallelStyle | str]]
"""``fn(module, tp_size, *, sequence_parallel, loss_parallel) -> plan``, names relative to ``module``."""

_REGISTRY: dict[Matcher, PlanFn] = {}


def register_plan(matcher: Matcher, plan_fn: PlanFn) -> None:
    """Register the tensor-parallel plan of an architecture; applies to every instance found inside a model.

    ``matcher``: an ``nn.Module`` subclass, or a predicate on module instances (tried after the types)."""
    check_matcher("register_plan", matcher)
    _REGISTRY[matcher] = plan_fn


def find_registered_plans(root: nn.Module) -> dict[str, PlanFn]:
    """Module name (``""`` for ``root`` itself) -> plan function, for the outermost registered modules."""
    return {name: plan_fn for name, _, plan_fn in outermost_registered(root, _REGISTRY)}


def _style(key: str, style: Any) -> ParallelStyle:
    if isinstance(style, ParallelStyle):
        return style
    if isinstance(style, str):
        if style not in STYLE_NAMES:
            raise ValueError(
                f"Tensor-parallel plan entry {key!r}: unknown style {style!r}. Use one of "
                f"{format_choices(STYLE_NAMES)} or a torch.distributed.tensor.parallel.ParallelStyle instance."
            )
        return STYLE_NAMES[style]()
    raise TypeError(
        f"Tensor-parallel plan entry {key!r} maps to {type(style).__name__}; expected a style name "
        f"({format_choices(STYLE_NAMES)}) or a ParallelStyle instance."
    )


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$")


def resolve_plan(module: nn.Module, plan: Mapping[str, ParallelStyle | str]) -> dict[str, ParallelStyle]:
    """Expand patterns to module names and style names to instances; reject what cannot work.

    Raises ``ValueError`` for a key that matches no module (with the closest names), a module
    matched by two keys, or a module that already holds DTensor parameters (a plan applied twice).
    """
    names = [n for n, _ in module.named_modules() if n]
    resolved: dict[str, ParallelStyle] = {}
    owner: dict[str, str] = {}
    for key, style in plan.items():
        parallel_style = _style(key, style)
        pattern = _pattern(key)
        matches = [n for n in names if pattern.match(n)]
        if not matches:
            generic = sorted({re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names})
            close = difflib.get_close_matches(key, generic, n=5, cutoff=0.5)
            raise ValueError(
                f"Tensor-parallel plan key {key!r} matches no module of {type(module).__name__}. "
                f"Closest module names: {close or generic[:8]}. Fix the key or remove it from the plan."
            )
        for name in matches:
            if name in owner:
                raise ValueError(
                    f"Module {name!r} is matched by tensor-parallel plan keys {owner[name]!r} and {key!r}; "
                    "give each module one style."
                )
            owner[name] = key
            resolved[name] = parallel_style
    for name in resolved:
        held = [p for p, t in module.get_submodule(name).named_parameters() if isinstance(t, DTensor)]
        if held:
            raise ValueError(
                f"Module {name!r} already holds DTensor parameters ({held[:3]}): tensor parallelism was applied "
                "to it before. Apply a plan once, to a model built with plain tensors."
            )
    return resolved


def _set_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, attr, param)


def apply_tensor_parallel(module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, ParallelStyle | str]) -> nn.Module:
    """Apply ``plan`` on the 1-D tensor-parallel ``mesh`` in place, keeping tied parameters tied.

    ``parallelize_module`` distributes each module's parameters on its own, so a parameter shared
    by two modules (a tied embedding and output head) would come back as two. After the plan runs,
    every tied group is pointed at one parameter again; the styles must give it one placement.
    """
    if mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D tensor-parallel mesh, got {mesh.ndim}-D {mesh}")
    resolved = resolve_plan(module, plan)
    tied = tied_parameter_groups(module)
    parallelize_module(module, mesh, resolved)
    for names in tied:
        params = [module.get_parameter(n) for n in names]
        distributed = [isinstance(p, DTensor) for p in params]
        if any(distributed) and not all(distributed):
            raise ValueError(
                f"Tied parameters {names}: the tensor-parallel plan distributes only "
                f"{[n for n, d in zip(names, distributed, strict=True) if d]}. Give every module sharing the "
                "parameter a style (e.g. embedding and head both sharded on vocab) or untie them."
            )
        placements = {tuple(p.placements) for p in params if isinstance(p, DTensor)}
        if len(placements) > 1:
            raise ValueError(
                f"Tied parameters {names} get different placements {sorted(map(str, placements))} under the "
                "tensor-parallel plan; shard them the same way (e.g. embedding and head both on vocab) or untie them."
            )
        for name in names:
            _set_parameter(module, name, params[0])
    return module


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with every DTensor gathered to a full tensor (a collective: call on all ranks)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()
    }
