"""How the data-parallel replicas agree: every step (gradients all-reduced, today's DDP/FSDP2), or
periodically (Local SGD, DiLoCo, Streaming DiLoCo). :class:`SyncSpec` says which, checked when it is
built; :func:`local_sgd`, :func:`diloco` and :func:`streaming_diloco` build one; :func:`sync_spec`
reads the forms a config gives (a name, a mapping, a spec). :mod:`lightning_scale.core.parallel.sync`
runs it.

- ``every_step``: every optimizer step averages the gradients over the ``dp`` group (one model).
- ``local_sgd(every=H)``: each replica steps on its own; after every H-th optimizer step the
  replicas' parameters are averaged (Lin et al. 2020, "Don't use large mini-batches, use local SGD").
- ``diloco(every=H, outer_lr, outer_momentum, nesterov)``: each replica runs its (inner) optimizer
  for H steps; then the pseudo-gradient ``anchor - parameters`` (the anchor: the parameters of the
  last synchronisation) is averaged over the replicas and an outer SGD step (Nesterov momentum by
  default) moves the anchor; every replica continues from it (Douillard et al. 2023, arXiv
  2311.08105). ``outer_lr=1, outer_momentum=0`` is Local SGD.
- ``streaming_diloco(every=H, fragments=F, overlap=True)``: the model's blocks in F contiguous
  fragments, each synchronised once every H steps as DiLoCo does, the fragments staggered over the
  H steps (fragment f after step ``(f + 1) * H // F`` of each round), so each exchange carries 1/F of
  the parameters; with ``overlap`` the exchange runs during the next inner step and is applied after
  it (a delay of one step; the fragment's local progress of that step is replaced by the outer
  result, as torchft's ``fragment_update_alpha=0``) (Douillard et al. 2025, arXiv 2501.18512).

``compression``: how the exchanged values travel (``none``: in the parameters' dtype; ``bf16``;
``int8``/``int4``: absmax-scaled integers per block of :data:`QUANT_BLOCK` values), each replica
keeping what its rounding lost and adding it to the next exchange (error feedback). Local SGD with
compression exchanges the change since the last synchronisation, not the parameters themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from lightning_scale.core.checks import check_positive_int, format_choices

__all__ = [
    "SYNC_COMPRESSIONS",
    "SYNC_MODES",
    "SyncSpec",
    "diloco",
    "local_sgd",
    "streaming_diloco",
    "sync_spec",
]

SYNC_MODES = ("every_step", "local_sgd", "diloco", "streaming_diloco")
SYNC_COMPRESSIONS = ("none", "bf16", "int8", "int4")


@dataclass(frozen=True)
class SyncSpec:
    """One data-parallel synchronisation mode and its settings (see the module docstring)."""

    mode: str = "every_step"
    every: int = 1
    """H: optimizer steps between two synchronisations of a (fragment of the) model."""
    outer_lr: float = 0.7
    """DiLoCo's outer learning rate (the paper's 0.7)."""
    outer_momentum: float = 0.9
    """DiLoCo's outer momentum (the paper's 0.9); 0: plain SGD."""
    nesterov: bool = True
    """Nesterov momentum for the outer step (ignored at ``outer_momentum=0``)."""
    fragments: int = 1
    """Streaming DiLoCo: fragments of contiguous blocks, synchronised in turn."""
    overlap: bool = False
    """Streaming DiLoCo: run each exchange during the next inner step (a one-step delay)."""
    compression: str = "none"

    def __post_init__(self) -> None:
        if self.mode not in SYNC_MODES:
            raise ValueError(
                f"data_parallel_sync mode {self.mode!r} is not one of {format_choices(SYNC_MODES)} (every_step: "
                "gradients averaged every step; local_sgd / diloco / streaming_diloco: replicas step alone and "
                "synchronise every H steps)."
            )
        check_positive_int(
            "every", self.every, fix="It is H, the optimizer steps between two synchronisations (e.g. every=50)."
        )
        check_positive_int("fragments", self.fragments, fix="It is the number of fragments of blocks (e.g. 4).")
        for name in ("nesterov", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True or False.")
        if self.compression not in SYNC_COMPRESSIONS:
            raise ValueError(
                f"compression={self.compression!r} is not one of {format_choices(SYNC_COMPRESSIONS)} for the "
                "periodic exchange."
            )
        lr, momentum = self.outer_lr, self.outer_momentum
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
            raise ValueError(f"outer_lr={lr!r} must be a positive finite number (DiLoCo's paper uses 0.7).")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(
                f"outer_momentum={momentum!r} must be in [0, 1) (DiLoCo's paper uses 0.9; 0: no momentum)."
            )
        if self.mode == "every_step":
            if self.every != 1 or self.compression != "none" or self.fragments != 1 or self.overlap:
                raise ValueError(
                    f"data_parallel_sync='every_step' synchronises every step and takes no every/fragments/overlap/"
                    f"compression (got {self._set_fields()}). Use local_sgd, diloco or streaming_diloco for periodic "
                    "synchronisation, or gradient_compression= for compressed every-step gradients."
                )
        if self.mode != "streaming_diloco" and (self.fragments != 1 or self.overlap):
            raise ValueError(
                f"fragments={self.fragments} and overlap={self.overlap} are streaming_diloco's; data_parallel_sync="
                f"{self.mode!r} exchanges the whole model at once. Use mode 'streaming_diloco' or remove them."
            )
        if self.fragments > self.every:
            raise ValueError(
                f"fragments={self.fragments} > every={self.every}: each fragment is synchronised once every H steps at "
                "its own step of the round, so there can be at most H fragments. Use fragments <= every."
            )
        if self.mode == "local_sgd" and (lr, momentum) != (0.7, 0.9) and (lr, momentum) != (1.0, 0.0):
            raise ValueError(
                f"outer_lr={lr} and outer_momentum={momentum} are DiLoCo's; local_sgd averages the parameters. "
                "Use mode 'diloco' for an outer optimizer."
            )
        if self.mode == "local_sgd":  # what it is: the outer step of lr 1 without momentum (no DiLoCo settings)
            lr, momentum = 1.0, 0.0
            object.__setattr__(self, "nesterov", False)
        object.__setattr__(self, "outer_lr", float(lr))
        object.__setattr__(self, "outer_momentum", float(momentum))

    def _set_fields(self) -> dict[str, Any]:
        defaults = SyncSpec.__dataclass_fields__
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != defaults[f.name].default
        }

    @property
    def periodic(self) -> bool:
        """Whether replicas step alone between synchronisations (every mode but ``every_step``)."""
        return self.mode != "every_step"

    @property
    def outer(self) -> bool:
        """Whether an outer optimizer steps the anchor (DiLoCo and Streaming DiLoCo)."""
        return self.mode in ("diloco", "streaming_diloco")

    def offsets(self) -> list[int]:
        """For each fragment, the step within a round of H after which it synchronises (``step % H``)."""
        return [((f + 1) * self.every // self.fragments) % self.every for f in range(self.fragments)]

    def due(self, step: int) -> list[int]:
        """The fragments whose exchange starts after optimizer step ``step`` (counted from 1)."""
        return [f for f, offset in enumerate(self.offsets()) if step % self.every == offset]

    def describe(self) -> str:
        if not self.periodic:
            return "every_step"
        parts = [f"every={self.every}"]
        if self.outer:
            parts += [f"outer_lr={self.outer_lr:g}", f"outer_momentum={self.outer_momentum:g}"]
            if self.outer_momentum > 0:
                parts.append(f"nesterov={self.nesterov}")
        if self.mode == "streaming_diloco":
            parts += [f"fragments={self.fragments}", f"overlap={self.overlap}"]
        if self.compression != "none":
            parts.append(f"compression={self.compression}")
        return f"{self.mode}({', '.join(parts)})"

    def as_dict(self) -> dict[str, Any]:
        """JSON values (a checkpoint's manifest, ``results.json``)."""
        return asdict(self)


def local_sgd(every: int, *, compression: str = "none") -> SyncSpec:
    """Average the replicas' parameters after every ``every``-th optimizer step."""
    return SyncSpec("local_sgd", every, compression=compression)


def diloco(
    every: int,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    *,
    compression: str = "none",
) -> SyncSpec:
    """DiLoCo: ``every`` inner steps, then an outer SGD step on the averaged pseudo-gradient."""
    return SyncSpec("diloco", every, outer_lr, outer_momentum, nesterov, compression=compression)


def streaming_diloco(
    every: int,
    fragments: int,
    overlap: bool = True,
    *,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    compression: str = "none",
) -> SyncSpec:
    """Streaming DiLoCo: DiLoCo per fragment of blocks, the fragments staggered, exchanges overlapped."""
    return SyncSpec("streaming_diloco", every, outer_lr, outer_momentum, nesterov, fragments, overlap, compression)


def sync_spec(value: Any, every: int | None = None) -> SyncSpec:
    """A :class:`SyncSpec` from a mode name (with ``every``: H), a mapping of its fields (``{"mode":
    "diloco", "every": 50, ...}``: a YAML config's), or a spec (``every`` must then agree or be None)."""
    if isinstance(value, SyncSpec):
        spec = value
    elif isinstance(value, str):
        if value == "every_step" and every not in (None, 1):
            raise ValueError(
                f"sync_every={every} is H of a periodic mode; data_parallel_sync='every_step' synchronises every step. "
                "Set data_parallel_sync to local_sgd, diloco or streaming_diloco, or remove sync_every."
            )
        return SyncSpec(value, 1 if value == "every_step" else _needs_every(value, every))
    elif isinstance(value, Mapping):
        known = {f.name for f in fields(SyncSpec)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"data_parallel_sync={dict(value)!r}: unknown keys {unknown}; the keys are {format_choices(known)}."
            )
        values = dict(value)
        if every is not None and values.setdefault("every", every) != every:
            raise ValueError(
                f"sync_every={every} and data_parallel_sync's every={values['every']} disagree; set one of them."
            )
        if "every" not in values and values.get("mode", "every_step") != "every_step":
            values["every"] = _needs_every(values.get("mode", "every_step"), None)
        return SyncSpec(**values)
    else:
        raise TypeError(
            f"data_parallel_sync must be a mode name ({format_choices(SYNC_MODES)}), a mapping of SyncSpec's fields "
            f"or a SyncSpec (lightning_scale.core.parallel.sync_spec.diloco(...)), got {type(value).__name__}."
        )
    if every is not None and every != spec.every:
        raise ValueError(f"sync_every={every} and {spec.describe()} disagree; set H in one place.")
    return spec


def _needs_every(mode: str, every: int | None) -> int:
    if every is None:
        if mode not in SYNC_MODES:
            SyncSpec(mode)  # the unknown-mode error
        raise ValueError(
            f"data_parallel_sync={mode!r} needs H, the steps between synchronisations: set sync_every (e.g. "
            f"strategy.sync_every=50) or pass {mode}(every=50)."
        )
    return every
