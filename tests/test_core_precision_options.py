"""The precision options, checked and resolved without Lightning."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_scale.core.precision.options import SCALER_DEFAULTS, PrecisionOptions

UNSET = dict.fromkeys(SCALER_DEFAULTS)


def _of(precision: str, **kwargs: object) -> PrecisionOptions:
    options = {"scaler": UNSET, "nonfinite_grads": None, "reduce_dtype": "float32", "norm_type": 2.0} | kwargs
    return PrecisionOptions.of(precision, **options)  # type: ignore[arg-type]


def test_fp16_fills_the_scalers_defaults_and_always_skips() -> None:
    options = _of("fp16-mixed", scaler=UNSET | {"growth_interval": 7})
    assert options == PrecisionOptions("16-mixed", SCALER_DEFAULTS | {"growth_interval": 7}, "skip", torch.float32, 2.0)


def test_other_modes_have_no_scaler_and_resolve_the_reduce_dtype_and_norm() -> None:
    assert _of("bf16-mixed", reduce_dtype=None, norm_type=math.inf) == PrecisionOptions(
        "bf16-mixed", None, "ignore", None, math.inf
    )
    assert _of("64-true", nonfinite_grads="raise", reduce_dtype="bfloat16", norm_type=1) == PrecisionOptions(
        "64-true", None, "raise", torch.bfloat16, 1.0
    )


@pytest.mark.parametrize(
    ("precision", "kwargs", "match"),
    [
        ("fp8", {}, r"precision='fp8' is not one of"),
        (
            "bf16-mixed",
            {"scaler": UNSET | {"min_scale": 2.0}},
            r"min_scale=2.0: loss-scaler options apply to precision='fp16-mixed' only",
        ),
        ("bf16-mixed", {"nonfinite_grads": "warn"}, r"nonfinite_grads='warn' is not one of 'ignore', 'raise', 'skip'"),
        (
            "fp16-mixed",
            {"nonfinite_grads": "raise"},
            r"nonfinite_grads='raise' with precision='fp16-mixed'.*Leave nonfinite_grads unset",
        ),
        ("32-true", {"reduce_dtype": "fp8"}, r"reduce_dtype='fp8' is not one of"),
        ("32-true", {"reduce_dtype": torch.float64}, r"reduce_dtype=torch.float64 must be torch.float32"),
        ("32-true", {"norm_type": 0}, r"norm_type=0 must be a positive number or inf"),
        ("32-true", {"norm_type": True}, r"norm_type=True must be a positive number or inf"),
    ],
)
def test_each_broken_rule_is_named(precision: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _of(precision, **kwargs)
