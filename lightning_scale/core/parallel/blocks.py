"""Transforms applied to a model's blocks in place before data parallelism wraps them: activation
checkpointing (recompute a block's activations in backward) and ``torch.compile``. Both keep module
names, hooks and parameters, so state dicts and the parallel wrappers see the same model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_scale.core.checks import check_positive_int, format_choices

__all__ = ["ACTIVATION_CHECKPOINTING", "COMPILE", "apply_activation_checkpointing", "compile_blocks", "resolve_compile"]

ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
COMPILE = (True, False, "auto")
"""The values of ``compile``: per-block ``torch.compile`` on, off, or on where the root device is CUDA."""


def apply_activation_checkpointing(blocks: Sequence[nn.Module], mode: str, every: int = 2) -> int:
    """Recompute blocks' activations in backward instead of keeping them; returns how many blocks.

    ``full``: every block; ``selective``: every ``every``-th block (the 1st, ``every+1``-th, ...).
    Only ``forward`` is wrapped (non-reentrant ``torch.utils.checkpoint``): module names, hooks and
    parameters are unchanged, so state dicts and tensor/data-parallel hooks see the same model.
    """
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing={mode!r} is not one of {format_choices(ACTIVATION_CHECKPOINTING)}.")
    check_positive_int("activation_checkpointing_every", every)
    if mode == "none":
        return 0
    chosen = list(blocks) if mode == "full" else list(blocks)[::every]
    for block in chosen:
        if getattr(block, "_lightning_scale_checkpointed", False):
            continue
        block.forward = functools.partial(_checkpointed, block.forward)  # type: ignore[method-assign]
        block._lightning_scale_checkpointed = True  # type: ignore[attr-defined]
    return len(chosen)


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def resolve_compile(compile: bool | str, device: torch.device | str) -> bool:
    """Whether to ``torch.compile`` each block on ``device``: ``True``/``False`` as given; ``"auto"`` when the
    device is CUDA (regional compilation, as torchtitan does: one compiled graph per block, reused by every
    block of the same structure, so compile time does not grow with depth), not on the CPU, where inductor's
    C++ compile takes longer than a short run gains."""
    if isinstance(compile, bool):
        return compile
    if compile == "auto":
        return torch.device(device).type == "cuda"
    raise ValueError(
        f"compile={compile!r} is not one of {', '.join(map(repr, COMPILE))}: True compiles each block, False none, "
        "'auto' each block where the root device is CUDA."
    )


def compile_blocks(blocks: Sequence[nn.Module], **compile_kwargs: Any) -> int:
    """``torch.compile`` each block in place (``Module.compile``: names and parameters unchanged); returns how
    many. Compilation itself happens at each block's first call (the first training step)."""
    for block in blocks:
        block.compile(**compile_kwargs)
    return len(blocks)
