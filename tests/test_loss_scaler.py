"""The fp16 loss scaler's state machine (``lightning_scale.core.precision.loss_scaler``) and the one-collective
gradient statistics (``lightning_scale.core.precision.grad_norm``), with no process group."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lightning_scale.core.precision.grad_norm import GradientScope, clip_grads_by_value_, gradient_stats, scale_grads_
from lightning_scale.core.precision.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError


def _run(scaler: DynamicLossScaler, pattern: str) -> list[tuple[bool, float]]:
    """Feed ``pattern`` ("." good step, "x" overflow); return (stepped, scale after) per step."""
    out = []
    for c in pattern:
        decision = scaler.update(overflow=c == "x")
        out.append((decision.step, decision.scale))
    return out


def test_growth_after_the_interval_and_backoff_on_every_overflow() -> None:
    scaler = DynamicLossScaler(init_scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, min_scale=1.0)
    got = _run(scaler, "...x...x..x")
    # Reference worked by hand: grows after 3 good steps, halves at each overflow, the count restarts.
    assert got == [
        (True, 8.0),
        (True, 8.0),
        (True, 16.0),
        (False, 8.0),
        (True, 8.0),
        (True, 8.0),
        (True, 16.0),
        (False, 8.0),
        (True, 8.0),
        (True, 8.0),
        (False, 4.0),
    ]
    assert scaler.skipped_steps == 3 and scaler.steps == 11 and scaler.growth_tracker == 0


def test_hysteresis_tolerates_overflows_in_a_row_then_backs_off_on_each() -> None:
    scaler = DynamicLossScaler(init_scale=64.0, growth_interval=100, hysteresis=3)
    got = _run(scaler, "xx.xxxx.x")
    assert [s for _, s in got] == [64.0, 64.0, 64.0, 64.0, 64.0, 32.0, 16.0, 16.0, 16.0]
    assert [stepped for stepped, _ in got] == [False, False, True, False, False, False, False, True, False]
    assert scaler.overflows_in_a_row == 1 and scaler.skipped_steps == 7


def test_the_scale_stops_at_the_minimum_and_the_policy_decides() -> None:
    skip = DynamicLossScaler(init_scale=4.0, min_scale=1.0, min_scale_policy="skip", growth_interval=100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [s for _, s in _run(skip, "xxxxx")] == [2.0, 1.0, 1.0, 1.0, 1.0]
    assert skip.skipped_steps == 5

    warned: list[str] = []
    warn = DynamicLossScaler(init_scale=2.0, min_scale=1.0, min_scale_policy="warn", warn=warned.append)
    _run(warn, "xx.x")
    assert len(warned) == 2 and "minimum loss scale (min_scale=1)" in warned[0] and "bf16" in warned[0]
    assert warn.scale == 1.0 and warn.skipped_steps == 3
    with pytest.warns(RuntimeWarning, match="min_scale_policy='warn'"):
        _run(DynamicLossScaler(init_scale=1.0, min_scale=1.0, min_scale_policy="warn"), "x")

    strict = DynamicLossScaler(init_scale=2.0, min_scale=1.0)  # "raise" is the default
    _run(strict, "x.")
    with pytest.raises(
        LossScaleAtMinimumError, match=r"overflow even at the minimum loss scale.*precision='bf16-mixed'"
    ):
        _run(strict, "x")
    # A backoff that only reaches the minimum is fine; the scale is clamped to it.
    clamped = DynamicLossScaler(init_scale=3.0, min_scale=2.0, backoff_factor=0.5)
    assert _run(clamped, "x") == [(False, 2.0)]


def test_growth_stops_before_the_scale_itself_overflows() -> None:
    scaler = DynamicLossScaler(init_scale=2.0**126, growth_interval=1, growth_factor=4.0)
    _run(scaler, "...")
    assert scaler.scale == 2.0**126  # 2**128 is beyond fp32, which the scaled loss is in
    assert math.isfinite(torch.tensor(scaler.scale, dtype=torch.float32).item())


def test_state_round_trips_and_continues_identically() -> None:
    a = DynamicLossScaler(init_scale=16.0, growth_interval=2, hysteresis=2)
    _run(a, ".x.xx.")
    b = DynamicLossScaler(init_scale=16.0, growth_interval=2, hysteresis=2)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert _run(a, "x..xx...") == _run(b, "x..xx...")
    with pytest.raises(ValueError, match=r"lacks \['growth_tracker'"):
        b.load_state_dict({"scale": 1.0})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"init_scale": 0}, ValueError, r"init_scale=0 must be a positive finite number"),
        ({"init_scale": float("inf")}, ValueError, r"init_scale=inf must be a positive finite number"),
        ({"growth_factor": 1.0}, ValueError, r"growth_factor=1.0 must be greater than 1"),
        ({"growth_factor": -2}, ValueError, r"growth_factor=-2 must be a positive"),
        ({"backoff_factor": 1.0}, ValueError, r"backoff_factor=1.0 must be below 1"),
        ({"backoff_factor": 0}, ValueError, r"backoff_factor=0 must be a positive"),
        ({"growth_interval": 0}, ValueError, r"growth_interval=0 must be a positive integer"),
        ({"growth_interval": 2.5}, TypeError, r"growth_interval must be an integer, got float"),
        ({"hysteresis": 0}, ValueError, r"hysteresis=0 must be a positive integer"),
        ({"min_scale": -1}, ValueError, r"min_scale=-1 must be a positive"),
        ({"min_scale": 2.0**20}, ValueError, r"min_scale=1048576.0 is above init_scale=65536.0"),
        (
            {"min_scale_policy": "ignore"},
            ValueError,
            r"min_scale_policy='ignore' is not one of 'raise', 'skip', 'warn'",
        ),
        ({"init_scale": "big"}, TypeError, r"init_scale must be a number, got str"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        DynamicLossScaler(**kwargs)


def _params(*grads: torch.Tensor | None) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype) if g is not None else torch.zeros(1))
        p.grad = g
        params.append(p)
    return params


def test_gradient_stats_without_a_process_group() -> None:
    params = _params(torch.tensor([3.0, 0.0]), torch.tensor([4.0], dtype=torch.bfloat16), None)
    stats = gradient_stats(params, GradientScope())
    assert stats.finite and stats.norm == pytest.approx(5.0)
    assert gradient_stats(params, GradientScope(), norm_type=float("inf")).norm == pytest.approx(4.0)
    # A parameter another stage counts (a tied copy) is left out of the norm, but still checked.
    excluded = GradientScope(excluded=[id(params[1])])
    assert gradient_stats(params, excluded).norm == pytest.approx(3.0)
    params[1].grad[0] = float("inf")
    bad = gradient_stats(params, excluded)
    assert not bad.finite and bad.nonfinite_local == (1,)
    params[0].grad[0] = float("nan")
    assert gradient_stats(params, GradientScope()).nonfinite_local == (0, 1)


def test_scaling_and_value_clipping_act_on_every_gradient() -> None:
    params = _params(torch.tensor([2.0, -8.0]), torch.tensor([0.5], dtype=torch.float16))
    scale_grads_(params, 0.5)
    assert params[0].grad.tolist() == [1.0, -4.0] and params[1].grad.tolist() == [0.25]
    clip_grads_by_value_(params, 2.0)
    assert params[0].grad.tolist() == [1.0, -2.0]
