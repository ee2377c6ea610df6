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

__all__ = ["ACTIVATION_CHECKPOINTING", "apply_activation_checkpointing", "compile_blocks"]

ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


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


def compile_blocks(blocks: Sequence[nn.Module], **compile_kwargs: Any) -> None:
    """``torch.compile`` each block in place (``Module.compile``: names and parameters unchanged)."""
    for block in blocks:
        block.compile(**compile_kwargs)
