from __future__ import annotations

import math

import pytest

from lightning_scale.core import divisors, format_choices, suggest_multiples, warmup_cosine
from lightning_scale.core.checks import check_positive_int, check_positive_number


def test_warmup_cosine_golden_values() -> None:
    kw = {"warmup_steps": 10, "total_steps": 110, "min_ratio": 0.1}
    assert warmup_cosine(0, **kw) == pytest.approx(0.1)
    assert warmup_cosine(4, **kw) == pytest.approx(0.5)
    assert warmup_cosine(10, **kw) == pytest.approx(1.0)
    # Halfway through the decay: min + (1 - min) / 2.
    assert warmup_cosine(60, **kw) == pytest.approx(0.55)
    assert warmup_cosine(110, **kw) == pytest.approx(0.1)
    assert warmup_cosine(500, **kw) == pytest.approx(0.1)
    assert warmup_cosine(35, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))


def test_warmup_cosine_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="min_ratio must lie in"):
        warmup_cosine(0, warmup_steps=1, total_steps=10, min_ratio=2.0)
    with pytest.raises(ValueError, match="total_steps >= 1"):
        warmup_cosine(0, warmup_steps=1, total_steps=0)


def test_divisors_and_suggestions() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1]
    assert divisors(49) == [1, 7, 49]
    assert suggest_multiples(130, 4) == [128, 132]
    assert suggest_multiples(3, 4) == [4]
    assert format_choices(["b", "a"]) == "'a', 'b'"
    with pytest.raises(ValueError, match="positive integer"):
        divisors(0)


@pytest.mark.parametrize("value", [0, -3, True, 2.0, "4", None])
def test_check_positive_int_names_the_value_and_the_rule(value: object) -> None:
    with pytest.raises(ValueError, match=r"^workers=.* must be a positive integer \(1 or more\)\. Pass 1 or more\.$"):
        check_positive_int("workers", value, fix="Pass 1 or more.")


@pytest.mark.parametrize("value", [0, -0.5, float("nan"), float("inf"), False, "1"])
def test_check_positive_number_names_the_value_the_unit_and_the_rule(value: object) -> None:
    with pytest.raises(ValueError, match=r"^timeout=.* must be a positive number of seconds\.$"):
        check_positive_number("timeout", value, unit="seconds")


def test_the_positive_checks_return_what_they_accept() -> None:
    assert check_positive_int("n", 3) == 3
    assert check_positive_number("t", 2) == 2.0 and isinstance(check_positive_number("t", 2), float)
