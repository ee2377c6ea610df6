"""A parallelised module's own state, as sharded checkpoints hold it: DCP's sharded state dicts
(DTensor shards, this rank's pipeline stage, no gather) under the original parameter names, each
tied weight stored once under its first name (:mod:`.ties`) and loaded into every copy.

Whole-model states (a ``torch.save`` file) load through :mod:`.full_state` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_scale.core.checkpoint.ties import (
    aliases_of_groups,
    groups_of_aliases,
    rename_optimizer_state,
    storage_aliases,
    with_aliases_filled,
)

__all__ = ["ShardedState"]

_SHARDED = StateDictOptions(full_state_dict=False)


class ShardedState:
    """The sharded state dicts of ``module`` and its optimizers, read and written in place.

    Args:
        module: the parallelised module (wrappers' prefixes are left out of its names).
        tied: the names of each weight tied across pipeline stages, as ``module`` names them, when a
            pipeline cut it (a rank may hold one copy only, so shared storage cannot tell);
            ``None``: no pipeline, tied weights are the entries sharing a tensor.
    """

    def __init__(self, module: nn.Module, tied: Sequence[Sequence[str]] | None = None) -> None:
        self.module = module
        self.tied = None if tied is None else [list(names) for names in tied]

    def live(self) -> dict[str, Any]:
        """This rank's model state under the original names, no copies (its tensors are the module's)."""
        return get_model_state_dict(self.module, options=_SHARDED)

    def aliases(self, state: Mapping[str, Any]) -> dict[str, str]:
        """``{name: canonical name}`` for every entry of ``state`` that is a copy of a tied weight."""
        return storage_aliases(state) if self.tied is None else aliases_of_groups(self.tied, present=state)

    def groups(self) -> list[list[str]]:
        """Every tied weight's names, the canonical (stored) one first."""
        return groups_of_aliases(storage_aliases(self.live())) if self.tied is None else self.tied

    def model_state(self) -> dict[str, Any]:
        """What a checkpoint stores of the model on this rank: each tied weight under its canonical name."""
        state = self.live()
        aliases = self.aliases(state)
        return {aliases.get(k, k): v for k, v in state.items()}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's sharded state, keyed by parameter names; a tied weight's under its canonical name."""
        state = get_optimizer_state_dict(self.module, optimizer, options=_SHARDED)
        # DCP names a shared parameter by one of its names (which one depends on the wrapping): the canonical one here.
        aliases = aliases_of_groups(self.groups())
        return rename_optimizer_state(state, aliases) if aliases else state

    def load_model_state(self, state: Mapping[str, Any], *, strict: bool = True, partial: bool = False) -> None:
        """Load a :meth:`model_state` in place; every local copy of a tied weight takes the canonical entry.
        ``partial`` (a pipeline stage) or not ``strict``: the entries this rank holds."""
        live = self.live()
        filled = with_aliases_filled(state, self.aliases(live))
        if partial or not strict:
            filled = {k: v for k, v in filled.items() if k in live}
        set_model_state_dict(self.module, filled, options=StateDictOptions(full_state_dict=False, strict=strict))

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
        """Load an :meth:`optimizer_state` in place, each tied weight's entry under the name DCP gives this rank's copy."""
        groups = self.groups()
        if groups:
            live = get_optimizer_state_dict(self.module, optimizer, options=_SHARDED)
            used = {n for g in live["param_groups"] for n in g["params"]}
            reverse = {names[0]: n for names in groups for n in names[1:] if n in used}
            state = rename_optimizer_state(state, reverse)
        set_optimizer_state_dict(self.module, optimizer, state, options=_SHARDED)
