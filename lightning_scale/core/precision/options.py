"""The precision modes and their options, checked before any work: which names are accepted, the dtypes
each mode computes and keeps in, the fp16 loss scaler's defaults, and :class:`PrecisionOptions`, what
a valid set of options resolves to (``lightning_scale.plugins.MixedPrecision`` takes it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lightning_scale.core.checks import format_choices

__all__ = ["COMPUTE_DTYPE", "NONFINITE_POLICIES", "PRECISIONS", "SCALER_DEFAULTS", "TRUE_DTYPE", "PrecisionOptions"]

PRECISIONS = {
    "fp16-mixed": "16-mixed",
    "16-mixed": "16-mixed",
    "bf16-mixed": "bf16-mixed",
    "bf16-true": "bf16-true",
    "32-true": "32-true",
    "64-true": "64-true",
}
"""Accepted names → Lightning's precision string (``trainer.precision``)."""

NONFINITE_POLICIES = ("ignore", "skip", "raise")
COMPUTE_DTYPE = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
"""The mixed modes: the dtype autocast computes in (weights, gradients and optimizer state stay fp32)."""
TRUE_DTYPE = {"bf16-true": torch.bfloat16, "32-true": torch.float32, "64-true": torch.float64}
"""The true modes: the one dtype of weights, gradients, optimizer state and compute."""
SCALER_DEFAULTS: dict[str, Any] = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "hysteresis": 1,
    "min_scale": 1.0,
    "min_scale_policy": "raise",
}
"""The fp16 loss scaler's options (``lightning_scale.core.precision.loss_scaler.DynamicLossScaler``) left unset."""
_REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PrecisionOptions:
    """What a checked set of precision options resolves to.

    ``precision``: Lightning's name; ``scaler``: the loss scaler's options with defaults filled in (fp16
    only, else None); ``nonfinite_grads``: the policy for non-finite gradients (fp16: always "skip");
    ``reduce_dtype``: FSDP2's gradient-reduction dtype (None: the compute dtype); ``norm_type``: the
    gradient norm's p."""

    precision: str
    scaler: dict[str, Any] | None
    nonfinite_grads: str
    reduce_dtype: torch.dtype | None
    norm_type: float

    @classmethod
    def of(
        cls,
        precision: str,
        *,
        scaler: dict[str, Any],
        nonfinite_grads: str | None,
        reduce_dtype: str | torch.dtype | None,
        norm_type: float,
    ) -> PrecisionOptions:
        """Check the options (``scaler``: name → value, None where unset); ``ValueError`` naming the value,
        the rule and the fix on the first one that breaks a rule."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not one of {format_choices(PRECISIONS)}.")
        fp16 = PRECISIONS[precision] == "16-mixed"
        set_options = [f"{k}={v!r}" for k, v in scaler.items() if v is not None]
        if set_options and not fp16:
            raise ValueError(
                f"{', '.join(set_options)}: loss-scaler options apply to precision='fp16-mixed' only; "
                f"precision={precision!r} has fp32's exponent range and needs no loss scaling. Drop them, or use "
                "precision='fp16-mixed'."
            )
        if nonfinite_grads is not None and nonfinite_grads not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite_grads={nonfinite_grads!r} is not one of {format_choices(NONFINITE_POLICIES)}.")
        if fp16 and nonfinite_grads not in (None, "skip"):
            raise ValueError(
                f"nonfinite_grads={nonfinite_grads!r} with precision='fp16-mixed': fp16 skips every step whose "
                "gradients overflow and backs the loss scale off; min_scale_policy says what happens when that keeps "
                "happening at the minimum scale. Leave nonfinite_grads unset."
            )
        if isinstance(reduce_dtype, str):
            if reduce_dtype not in _REDUCE_DTYPES:
                raise ValueError(f"reduce_dtype={reduce_dtype!r} is not one of {format_choices(_REDUCE_DTYPES)}.")
            reduce_dtype = _REDUCE_DTYPES[reduce_dtype]
        elif reduce_dtype is not None and reduce_dtype not in _REDUCE_DTYPES.values():
            raise ValueError(f"reduce_dtype={reduce_dtype!r} must be torch.float32, torch.bfloat16 or torch.float16.")
        if (
            isinstance(norm_type, bool)
            or not isinstance(norm_type, (int, float))
            or not (norm_type == math.inf or norm_type > 0)
        ):
            raise ValueError(f"norm_type={norm_type!r} must be a positive number or inf.")
        return cls(
            precision=PRECISIONS[precision],
            scaler={k: (SCALER_DEFAULTS[k] if v is None else v) for k, v in scaler.items()} if fp16 else None,
            nonfinite_grads="skip" if fp16 else (nonfinite_grads or "ignore"),
            reduce_dtype=reduce_dtype,
            norm_type=float(norm_type),
        )
