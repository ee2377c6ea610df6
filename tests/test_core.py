from __future__ import annotations

import math

import pytest

from lightning_scale.core import divisors, format_choices, suggest_multiples, warmup_cosine


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
