"""What a LightningModule was parallelised for, kept on the module so that the next Trainer (``fit``
with one, ``test`` with another) adopts the same mesh and pipeline instead of cutting it again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_scale.core.parallel.layout import Layout
from lightning_scale.core.pipeline.runner import PipelineRunner
from lightning_scale.core.telemetry.model_facts import ModelFacts
from lightning_scale.strategies.hybrid.options import ParallelOptions

__all__ = ["ParallelState"]

_STATE = "_lightning_scale_parallel"
"""Attribute of a LightningModule that the strategy cut and wrapped: a :class:`ParallelState`."""


@dataclass(frozen=True)
class _CopiedState:
    """What a copy of a cut module carries instead of the state: a copy has no stages or process groups."""

    layout: Layout


@dataclass(frozen=True)
class ParallelState:
    """The layout, options, mesh, pipeline and FSDP2 precision policy a module was cut and wrapped with.

    It holds process groups, which cannot be copied: copying or pickling the module
    (``copy.deepcopy``, ``StochasticWeightAveraging``, ``torch.save``) leaves a marker instead, and
    the copy is refused when it is set up.
    """

    layout: Layout
    hsdp: tuple[int, int] | None
    options: ParallelOptions
    mesh: DeviceMesh
    pipeline: PipelineRunner | None
    mp_policy: Any = None
    """FSDP2's ``MixedPrecisionPolicy`` the module was sharded with (``None``: none)."""
    facts: ModelFacts | None = None
    """The whole model's counts, taken before it was cut."""

    def attach(self, module: nn.Module) -> None:
        setattr(module, _STATE, self)

    @staticmethod
    def needed(layout: Layout, options: ParallelOptions) -> bool:
        """Whether a module cut for ``layout`` and ``options`` must be adopted, not cut, by the next Trainer:
        anything but plain DDP (or one process) with neither activation checkpointing nor compile."""
        untouched = layout.tp == 1 and layout.pp == 1 and (layout.dp == 1 or options.data_parallel_mode == "ddp")
        return not (untouched and options.activation_checkpointing == "none" and not options.compile)

    @staticmethod
    def adopted(module: nn.Module, layout: Layout, mp_policy: Any, precision: str) -> ParallelState | None:
        """The state of ``module`` if an earlier Trainer cut it (``None``: never cut); ``ValueError`` when
        it was sharded with another FSDP2 precision policy than ``mp_policy`` (``precision``: this one's)."""
        state = ParallelState.of(module, layout, None, None)
        if state is not None and state.mp_policy != mp_policy:
            raise ValueError(
                f"{type(module).__name__} was sharded by FSDP2 with mixed precision {state.mp_policy} by an earlier "
                f"Trainer; this one asks for {mp_policy} (precision={precision!r}). Use the same "
                "precision, or load the checkpoint into a fresh module."
            )
        return state

    @staticmethod
    def of(
        module: nn.Module, layout: Layout, hsdp: tuple[int, int] | None, options: ParallelOptions | None
    ) -> ParallelState | None:
        """The module's state (``None``: never cut). With ``options``, raise ``ValueError`` unless a Trainer
        set up at ``layout``, ``hsdp`` and ``options`` can adopt it."""
        state = getattr(module, _STATE, None)
        if isinstance(state, _CopiedState):
            raise ValueError(
                f"{type(module).__name__} is a copy of a module cut and wrapped for {state.layout}; a copy has no "
                "pipeline stages or process groups of its own to be set up with. Set up the original, or load a "
                "checkpoint into a fresh module."
            )
        if state is None or options is None:
            return state
        differences = [] if state.layout == layout else [f"layout {state.layout} vs {layout}"]
        if state.hsdp != hsdp:
            differences.append(f"hsdp (replicate, shard) {state.hsdp} vs {hsdp}")
        differences += state.options.structural_differences(options, layout)
        if differences:
            raise ValueError(
                f"{type(module).__name__} was already cut and wrapped for {state.layout} by an earlier Trainer "
                f"and cannot be set up again with other settings ({'; '.join(differences)}). Build a new module, "
                "or load its checkpoint into one (LightningModule.load_from_checkpoint), for another layout."
            )
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> _CopiedState:
        return _CopiedState(self.layout)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_CopiedState, (self.layout,))
