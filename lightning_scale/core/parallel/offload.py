"""Activation offloading: what chosen blocks save for their backward is kept in host memory
(``torch.autograd.graph.save_on_cpu``), copied back when the backward needs it.

Applied to blocks in place, like activation checkpointing (:mod:`.blocks`): only ``forward`` is wrapped, so
module names, hooks and parameters are unchanged. It composes with the rest of what the strategy does to a
block: under ``torch.compile`` the context is entered around the compiled forward's autograd graph, whose
saved tensors it packs; a checkpointed block saves only its input (the checkpoint holds it itself, and its
own saved-tensor hooks take the tensors the block saves inside), so offloading it moves next to nothing;
under a pipeline each rank offloads the blocks it holds. On CUDA the host copies are pinned and
non-blocking (``pin_memory=True``), on the compute stream: they do not overlap the compute. On the CPU the
"copy" is the tensor itself (``Tensor.cpu()`` of a CPU tensor), so a run equals the run without.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu

_STATS = "_lightning_scale_offload_stats"  # on each offloaded block: what it packed
__all__ = ["OffloadStats", "apply_activation_offload", "check_activation_offload", "offload_stats", "offloaded_blocks"]


@dataclass
class OffloadStats:
    """What the offloaded blocks' forwards packed for host memory so far (this process, cumulative)."""

    tensors: int = 0
    bytes: int = 0


class _CountedSaveOnCpu(save_on_cpu):
    """``save_on_cpu``, counting what it packs."""

    def __init__(self, pin_memory: bool, *stats: OffloadStats | None) -> None:
        super().__init__(pin_memory=pin_memory)
        pack = self.pack_hook
        counters = [s for s in stats if s is not None]

        def counted(tensor: torch.Tensor) -> Any:
            for counter in counters:
                counter.tensors += 1
                counter.bytes += tensor.numel() * tensor.element_size()
            return pack(tensor)

        self.pack_hook = counted


def check_activation_offload(value: Any) -> None:
    """``activation_offload``: ``0`` (off), a number of blocks ``N >= 0`` (each pipeline rank's first ``N``),
    ``"auto"`` (the planner's fewest that make the layout fit), or a list of block indices (in the model's
    block order, each ``>= 0``, no repeats); ``ValueError``/``TypeError`` naming the value and what to pass."""
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(
                f"activation_offload={value!r} is not 'auto': pass 'auto' (the planner's fewest blocks that make the "
                "layout fit), a number of blocks (each pipeline rank's first N; 0: off) or a list of block indices."
            )
        return
    if isinstance(value, bool) or not isinstance(value, (int, Sequence)):
        raise TypeError(
            f"activation_offload={value!r} must be a number of blocks (0: off), 'auto', or a list of block indices."
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(
                f"activation_offload={value} is negative: pass the number of blocks (from each pipeline rank's first) "
                "whose saved activations go to host memory, 0 for none."
            )
        return
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value) or len(set(value)) < len(
        value
    ):
        raise ValueError(
            f"activation_offload={list(value)!r}: a list must hold distinct block indices >= 0 (the model's block order)."
        )


def offloaded_blocks(setting: int | Sequence[int], block_indices: Sequence[int]) -> list[bool]:
    """Which of a rank's blocks (``block_indices``: their indices in the model's block order, in the order the
    rank holds them) to offload: the first ``setting`` when it is a number, else those whose index it lists."""
    if isinstance(setting, int):
        return [i < setting for i in range(len(block_indices))]
    listed = set(setting)
    return [b in listed for b in block_indices]


def apply_activation_offload(
    blocks: Sequence[nn.Module], chosen: Sequence[bool], *, pin_memory: bool, stats: OffloadStats | None = None
) -> int:
    """Keep what each chosen block's forward saves for its backward in host memory (pinned when
    ``pin_memory``), counted per block (:func:`offload_stats`) and in ``stats``; returns how many blocks. Apply after activation checkpointing
    and before ``torch.compile`` and the data-parallel wrappers (the order of
    :func:`~lightning_scale.strategies.hybrid.parallelize.parallelize`)."""
    if len(chosen) != len(blocks):
        raise ValueError(f"{len(chosen)} choices for {len(blocks)} blocks: give one per block.")
    count = 0
    for block, offload in zip(blocks, chosen, strict=True):
        if not offload or getattr(block, _STATS, None) is not None:
            continue
        own = OffloadStats()
        block.forward = functools.partial(_offloaded, block.forward, pin_memory, own, stats)  # type: ignore[method-assign]
        setattr(block, _STATS, own)
        count += 1
    return count


def offload_stats(module: nn.Module) -> OffloadStats:
    """What the offloaded blocks inside ``module`` packed for host memory so far, summed (zero: none offloaded)."""
    total = OffloadStats()
    for sub in module.modules():
        own = getattr(sub, _STATS, None)
        if isinstance(own, OffloadStats):
            total.tensors += own.tensors
            total.bytes += own.bytes
    return total


def _offloaded(
    forward: Callable[..., Any],
    pin_memory: bool,
    own: OffloadStats,
    shared: OffloadStats | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    if not torch.is_grad_enabled():  # nothing is saved for a backward
        return forward(*args, **kwargs)
    with _CountedSaveOnCpu(pin_memory, own, shared):
        return forward(*args, **kwargs)
