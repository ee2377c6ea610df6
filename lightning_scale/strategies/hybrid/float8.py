"""Float8 training of the linear layers inside a model's blocks, through torchao (``float8=`` of
:class:`~lightning_scale.strategies.HybridParallelStrategy`; ``pip install lightning-scale[fp8]``).

torchao is imported here only, and only when float8 is asked for. Its ``Float8Linear`` (a subclass of
``nn.Linear``, same parameter names) replaces each eligible ``nn.Linear`` of each block before tensor
parallelism and FSDP2 wrap them (:func:`~lightning_scale.strategies.hybrid.parallelize.parallelize`, step 2),
so checkpoints, tensor-parallel plans and state dicts see the same model. Embeddings and the output head
(outside the blocks) stay in the compute dtype, as torchtitan does: the head's logits feed the loss.

Where it runs: float8 matmuls (``torch._scaled_mm``) need a GPU of compute capability 8.9 or more (Ada,
Hopper, Blackwell); an older GPU is refused before any work. On the CPU torchao emulates them (the
casts and scales are real, the matmul runs in the compute dtype): that is for correctness, not speed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_scale.core.checks import format_choices

__all__ = [
    "FLOAT8_RECIPES",
    "FLOAT8_MIN_CAPABILITY",
    "check_float8",
    "check_float8_run",
    "convert_float8",
    "float8_linears",
]

FLOAT8_RECIPES = ("rowwise", "tensorwise")
"""torchao's scaling recipes (``Float8LinearConfig.from_recipe_name``): ``rowwise`` scales each row of the
inputs and weights (more accurate, torchtitan's choice with FSDP2), ``tensorwise`` one scale per tensor."""

FLOAT8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability float8 matmuls need: Ada (8.9) and Hopper (9.0) or newer."""

_ALIGNMENT = 16
"""torchao's float8 matmul needs both dimensions of a linear's weight to be multiples of 16."""

_INSTALL = "pip install 'lightning-scale[fp8]' (torchao>=0.18,<0.19)"


def check_float8(recipe: str | None) -> None:
    """The value of ``float8`` (None, or one of :data:`FLOAT8_RECIPES`) and that torchao is installed; at the
    strategy's construction, before any process starts."""
    if recipe is None:
        return
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(
            f"float8={recipe!r} is not a torchao float8 recipe: use one of {format_choices(FLOAT8_RECIPES)} "
            "(rowwise is the more accurate), or None to train the linears in the compute dtype."
        )
    if importlib.util.find_spec("torchao") is None:
        raise ValueError(f"float8={recipe!r} trains through torchao, which is not installed: {_INSTALL}.")


def check_float8_run(recipe: str | None, device: torch.device, precision: str) -> None:
    """What float8 needs of the run, before the model is touched: a GPU with float8 matmuls (or the CPU,
    emulated) and a precision torchao's recipes support (not fp16: its loss-scaled gradients are outside the
    range torchao's float8 casts are validated for; torchao trains under bf16 or fp32)."""
    if recipe is None:
        return
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) < FLOAT8_MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise ValueError(
                f"float8={recipe!r} needs float8 matmuls, which {name} (compute capability "
                f"{capability[0]}.{capability[1]}) does not have: they need compute capability >= "
                f"{FLOAT8_MIN_CAPABILITY[0]}.{FLOAT8_MIN_CAPABILITY[1]} (Ada, Hopper: L4, L40S, H100, H200). "
                "Use float8=None (precision bf16-mixed) on this GPU."
            )
    elif device.type != "cpu":
        raise ValueError(f"float8={recipe!r} runs on CUDA GPUs (and emulated on the CPU), not on {device.type}.")
    if precision.startswith("16") or precision.startswith("fp16"):
        raise ValueError(
            f"float8={recipe!r} with precision={precision!r}: torchao's float8 training supports bf16 and fp32 "
            "compute, not fp16 with loss scaling. Use precision='bf16-mixed' (Hydra: precision=bf16 or fp8)."
        )


def _eligible(module: nn.Module, fqn: str) -> bool:
    return (
        bool(fqn)  # never the block itself: it stays the module the pipeline and the wrappers know
        and isinstance(module, nn.Linear)
        and module.in_features % _ALIGNMENT == 0
        and module.out_features % _ALIGNMENT == 0
    )


def convert_float8(blocks: Sequence[nn.Module], recipe: str, device: torch.device) -> tuple[int, int]:
    """Swap the eligible ``nn.Linear`` layers of each block (both dimensions multiples of 16) for torchao's
    ``Float8Linear`` in place (names, parameters and their values unchanged; meta tensors stay meta); returns
    (linears converted, linears left: a dimension not a multiple of 16)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise ValueError(
            f"float8={recipe!r} trains through torchao, which failed to import ({err}): {_INSTALL}."
        ) from None
    config = Float8LinearConfig.from_recipe_name(recipe)
    converted = left = 0
    for block in blocks:
        linears = [(n, m) for n, m in block.named_modules() if n and isinstance(m, nn.Linear)]
        chosen = sum(_eligible(m, n) for n, m in linears)
        converted, left = converted + chosen, left + len(linears) - chosen
        if chosen:
            convert_to_float8_training(block, config=config, module_filter_fn=_eligible)
    where = "emulated on the CPU: for correctness, not speed" if device.type == "cpu" else f"on {device.type}"
    rank_zero_info(
        f"float8={recipe!r} (torchao): {converted} linear layers of {len(blocks)} blocks train in float8 ({where})"
        + (f"; {left} left in the compute dtype (a dimension not a multiple of {_ALIGNMENT})" if left else "")
        + "; embeddings and the output head stay in the compute dtype."
    )
    return converted, left


def float8_linears(module: nn.Module) -> list[str]:
    """The names of ``module``'s torchao ``Float8Linear`` layers (none without torchao)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [name for name, m in module.named_modules() if isinstance(m, Float8Linear)]
