"""Dynamic loss scaling for fp16 training: the state machine, with no process group and no Lightning.

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a large
``scale`` before the backward lifts them into range; the gradients are divided by it again before
the optimizer step. A step whose gradients overflowed (a non-finite global gradient norm) is
skipped and the scale backs off; after ``growth_interval`` good steps in a row it grows again.

:class:`DynamicLossScaler` only decides: the caller measures the overflow once for the whole
model (``lightning_scale.core.precision.grad_norm.gradient_stats``: one collective over every rank of every
mesh dimension), so every rank feeds the same sequence of overflows in and holds the same state.

Rules, for ``update(overflow)``:

- a good step: the overflow streak ends; after ``growth_interval`` good steps in a row the scale is
  multiplied by ``growth_factor`` (and the count starts again);
- an overflow: the step is skipped (``skipped_steps`` counts it) and the good-step count starts
  again. ``hysteresis = h`` tolerates ``h - 1`` overflows in a row before backing off: the ``h``-th
  consecutive overflow, and every further one in the same streak, multiplies the scale by
  ``backoff_factor`` (DeepSpeed's ``hysteresis`` with ``consecutive_hysteresis=True``; ``h = 1`` is
  torch's ``GradScaler``);
- the scale never goes below ``min_scale``. An overflow that should back off while the scale is
  already at ``min_scale`` means the gradients overflow fp16 whatever the scale: the
  ``min_scale_policy`` says what happens — ``"raise"`` (:class:`LossScaleAtMinimumError`, suggesting
  bf16), ``"warn"`` (skip the step and warn) or ``"skip"`` (skip it silently; it is still counted).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_scale.core.checks import check_positive_int, check_positive_number, format_choices

__all__ = ["MIN_SCALE_POLICIES", "DynamicLossScaler", "LossScaleAtMinimumError", "ScalerStep"]

MIN_SCALE_POLICIES = ("raise", "skip", "warn")
_FP32_MAX = 3.4028234663852886e38


class LossScaleAtMinimumError(FloatingPointError):
    """fp16 gradients overflow even at the minimum loss scale (``min_scale_policy="raise"``)."""


@dataclass(frozen=True)
class ScalerStep:
    """What :meth:`DynamicLossScaler.update` decided for one optimizer step."""

    step: bool
    """Take the optimizer step (False: an overflow, skip it and the LR schedulers' step)."""
    scale: float
    """The scale after the update (for the next backward)."""
    backed_off: bool = False
    grew: bool = False
    at_minimum: bool = False
    """An overflow that should have backed off, with the scale already at ``min_scale``."""


def _positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}.")
    return check_positive_number(name, value)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}.")
    return check_positive_int(name, value)


class DynamicLossScaler:
    """Loss scale, growth and backoff, hysteresis and a minimum scale with a policy (module docstring).

    Args:
        init_scale: the first scale (torch's and DeepSpeed's default, ``2**16``).
        growth_factor: multiplies the scale after ``growth_interval`` good steps in a row; ``> 1``.
        backoff_factor: multiplies the scale on an overflow; strictly between 0 and 1.
        growth_interval: good steps in a row before the scale grows.
        hysteresis: overflows in a row before the scale backs off (1: on every overflow).
        min_scale: the scale never goes below this; at most ``init_scale``.
        min_scale_policy: ``"raise"``, ``"warn"`` or ``"skip"``: an overflow at the minimum scale.
        warn: how ``"warn"`` reports (default ``warnings.warn``; a rank-zero-only function under
            several processes).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        min_scale_policy: str = "raise",
        warn: Callable[[str], Any] | None = None,
    ) -> None:
        self.init_scale = _positive_number("init_scale", init_scale)
        self.growth_factor = _positive_number("growth_factor", growth_factor)
        if self.growth_factor <= 1:
            raise ValueError(f"growth_factor={growth_factor} must be greater than 1 (the scale grows by it), e.g. 2.0.")
        self.backoff_factor = _positive_number("backoff_factor", backoff_factor)
        if self.backoff_factor >= 1:
            raise ValueError(f"backoff_factor={backoff_factor} must be below 1 (the scale shrinks by it), e.g. 0.5.")
        self.growth_interval = _positive_int("growth_interval", growth_interval)
        self.hysteresis = _positive_int("hysteresis", hysteresis)
        self.min_scale = _positive_number("min_scale", min_scale)
        if self.min_scale > self.init_scale:
            raise ValueError(
                f"min_scale={min_scale} is above init_scale={init_scale}; the scale starts at init_scale and never "
                "goes below min_scale. Lower min_scale or raise init_scale."
            )
        if min_scale_policy not in MIN_SCALE_POLICIES:
            raise ValueError(
                f"min_scale_policy={min_scale_policy!r} is not one of {format_choices(MIN_SCALE_POLICIES)}."
            )
        self.min_scale_policy = min_scale_policy
        self._warn = warn if warn is not None else lambda message: warnings.warn(message, RuntimeWarning, stacklevel=3)
        self.scale = self.init_scale
        self.growth_tracker = 0
        """Good steps in a row since the last growth or overflow."""
        self.overflows_in_a_row = 0
        self.skipped_steps = 0
        self.steps = 0
        """Optimizer steps decided (good and skipped)."""

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, overflow: bool) -> ScalerStep:
        """Decide one optimizer step from whether its gradients overflowed; returns the decision."""
        self.steps += 1
        if not overflow:
            self.overflows_in_a_row = 0
            self.growth_tracker += 1
            grew = self.growth_tracker >= self.growth_interval
            if grew:
                self.growth_tracker = 0
                grown = self.scale * self.growth_factor
                # The scale multiplies fp32 losses: past fp32's range it would make them inf.
                if grown <= _FP32_MAX:
                    self.scale = grown
            return ScalerStep(step=True, scale=self.scale, grew=grew)
        self.skipped_steps += 1
        self.growth_tracker = 0
        self.overflows_in_a_row += 1
        if self.overflows_in_a_row < self.hysteresis:
            return ScalerStep(step=False, scale=self.scale)
        if self.scale <= self.min_scale:
            self._at_minimum()
            return ScalerStep(step=False, scale=self.scale, at_minimum=True)
        self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        return ScalerStep(step=False, scale=self.scale, backed_off=True)

    def _at_minimum(self) -> None:
        message = (
            f"fp16 gradients overflow even at the minimum loss scale (min_scale={self.min_scale:g}) at optimizer step "
            f"{self.steps} ({self.skipped_steps} steps skipped so far, {self.overflows_in_a_row} in a row): the "
            "gradients exceed fp16's range whatever the scale. Train in bf16 (precision='bf16-mixed', same range as "
            "fp32), lower the learning rate or clip gradients, or lower min_scale."
        )
        if self.min_scale_policy == "raise":
            raise LossScaleAtMinimumError(message)
        if self.min_scale_policy == "warn":
            self._warn(message + " The step is skipped (min_scale_policy='warn').")

    _STATE_KEYS = ("scale", "growth_tracker", "overflows_in_a_row", "skipped_steps", "steps")

    def state_dict(self) -> dict[str, Any]:
        """The changing state (the settings are the constructor's): equal on every rank."""
        return {key: getattr(self, key) for key in self._STATE_KEYS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = [key for key in self._STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"The loss scaler state lacks {missing}; it has {sorted(state)}.")
        scale = _positive_number("scale", state["scale"])
        self.scale = scale
        for key in self._STATE_KEYS[1:]:
            setattr(self, key, int(state[key]))
