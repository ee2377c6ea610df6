"""FLOPs per token of a training step, and the utilisation they imply. No Lightning.

The analytic count for a decoder transformer (PaLM, Chowdhery et al. 2022, appendix B)::

    6 N + 12 L H Q T        per token, forward and backward

- ``N``: the parameters that multiply activations, i.e. the weights of the linear layers, the output
  head included (its matmul runs whatever the weight is tied to). A forward pass spends 2 FLOPs
  per such parameter and token (a multiply and an add); the backward pass twice that (the
  gradients of the activations and of the weights): 6N.
- ``12 L H Q T``: attention's two matmuls (scores ``QK^T`` and ``scores @ V``), ``2 H Q T`` FLOPs
  each per token and layer forward, times 3 for the backward, with ``L`` layers, ``H`` query heads
  of width ``Q`` and ``T`` tokens of context. Causal attention needs only half the score matrix:
  ``causal=True`` halves the term (kernels like FlashAttention skip the masked half); the default,
  the full product, is what ``torch.utils.flop_counter`` counts for SDPA.
- Excluded, as everywhere: embedding lookups (no arithmetic), norms, activations, softmax, the
  loss, biases and the optimizer; these are a few per cent at most for real sizes.

Activation checkpointing recomputes forwards in the backward: hardware FLOPs exceed model FLOPs
(which stay as above). The textbook figure, ``8N + 16 L H Q T`` for a whole forward recomputed once
(:func:`hardware_flops_per_token`), is an upper bound: only the checkpointed blocks recompute, never
the head or the embeddings, and torch's non-reentrant checkpoint stops re-running a block once the
tensors its backward needs are back, so a block's last linear layer is not recomputed. With every
block of the reference GPT checkpointed, ``FlopCounterMode`` counts hardware/model = 1.242 (tiny,
256 tokens), 1.177 (gpt2-124m, 1024), 1.265 (7b, 4096), where the textbook figure gives 1.333.
The ``Throughput`` callback counts the recomputation instead
(:meth:`lightning_scale.core.telemetry.model_facts.ModelFacts.measure_recomputation`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_scale.core.checks import check_positive_int

__all__ = [
    "hardware_flops_per_token",
    "matmul_parameters",
    "measured_flops_per_token",
    "model_flops_utilization",
    "transformer_flops_per_token",
]


def matmul_parameters(module: nn.Module) -> int:
    """Weights that multiply activations: every ``nn.Linear`` (and HF ``Conv1D``, GPT-2's linear)
    weight, counted once per module that uses it (a tied output head counts: its matmul runs).
    Works on meta tensors and DTensors (their global size)."""
    total = 0
    for sub in module.modules():
        if isinstance(sub, nn.Linear) or type(sub).__name__ == "Conv1D":
            weight = getattr(sub, "weight", None)
            if isinstance(weight, torch.Tensor):
                total += weight.numel()
    return total


def _check(**values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} must be a non-negative integer.")


def transformer_flops_per_token(
    matmul_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int, *, causal: bool = False
) -> float:
    """``6N + 12·L·H·Q·T`` (``causal``: ``6N + 6·L·H·Q·T``): training FLOPs per token, see the module doc."""
    _check(matmul_params=matmul_params, n_layers=n_layers, n_heads=n_heads, head_dim=head_dim, seq_len=seq_len)
    attention = 12 * n_layers * n_heads * head_dim * seq_len
    return float(6 * matmul_params + (attention // 2 if causal else attention))


def hardware_flops_per_token(
    matmul_params: int,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    seq_len: int,
    *,
    recomputed_fraction: float = 1.0,
    causal: bool = False,
) -> float:
    """The textbook hardware FLOPs per token (Megatron-LM's and PaLM's convention): model FLOPs plus
    ``recomputed_fraction`` of one more whole forward (``2N + 4·L·H·Q·T``; 1.0: ``8N + 16·L·H·Q·T``).

    An upper bound, for planning: torch's checkpointing recomputes less (not the head, not a block's
    last linear layer; see the module doc), so this is 5-13% above the count for the reference GPT
    presets. For what a run really recomputes, count it (``ModelFacts.measure_recomputation``, which
    ``Throughput``'s ``train/hfu`` uses)."""
    if not 0.0 <= recomputed_fraction <= 1.0:
        raise ValueError(f"recomputed_fraction={recomputed_fraction!r} must be between 0 and 1.")
    model = transformer_flops_per_token(matmul_params, n_layers, n_heads, head_dim, seq_len, causal=causal)
    attention = 4 * n_layers * n_heads * head_dim * seq_len
    forward = 2 * matmul_params + (attention // 2 if causal else attention)
    return model + recomputed_fraction * forward


def measured_flops_per_token(step: Callable[[], Any], tokens: int) -> float:
    """FLOPs per token of ``step`` (a forward and backward, e.g. on meta tensors, which compute
    nothing) counted by ``torch.utils.flop_counter.FlopCounterMode``: the fallback for models the
    analytic count does not describe."""
    from torch.utils.flop_counter import FlopCounterMode

    check_positive_int("tokens", tokens, fix="It counts the tokens the step processes.")
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops() / tokens


def model_flops_utilization(
    flops_per_token: float, tokens_per_second: float, devices: int, peak_flops_per_device: float
) -> float:
    """MFU: the FLOPs the model needs per second, as a fraction of what ``devices`` devices can do."""
    if devices < 1 or peak_flops_per_device <= 0:
        raise ValueError(f"devices={devices!r} and peak_flops_per_device={peak_flops_per_device!r} must be positive.")
    return flops_per_token * tokens_per_second / (devices * peak_flops_per_device)
