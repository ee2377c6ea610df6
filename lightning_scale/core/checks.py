"""Helpers that turn a broken rule into an error message that says how to fix it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["check_positive_int", "check_positive_number", "divisors", "format_choices", "suggest_multiples"]


def check_positive_int(name: str, value: Any, *, fix: str = "") -> int:
    """``value`` if it is an integer of 1 or more (``bool`` is not), else a ``ValueError`` naming
    ``name``, the value and the rule, then ``fix`` (a sentence saying what to pass) when given."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer (1 or more).{' ' + fix if fix else ''}")
    return value


def check_positive_number(name: str, value: Any, *, unit: str = "", fix: str = "") -> float:
    """``value`` as a float if it is a finite number above 0 (``bool`` is not), else a ``ValueError``
    naming ``name``, the value and the rule (``unit``: what the number counts, e.g. "seconds")."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
    if not ok:
        what = f" number of {unit}" if unit else " finite number"
        raise ValueError(f"{name}={value!r} must be a positive{what}.{' ' + fix if fix else ''}")
    return float(value)


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order (``n >= 1``)."""
    if n < 1:
        raise ValueError(f"divisors() needs a positive integer, got {n}")
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def suggest_multiples(value: int, of: int) -> list[int]:
    """The multiples of ``of`` closest to ``value`` (below and above), for "did you mean" hints."""
    if of < 1:
        raise ValueError(f"suggest_multiples() needs a positive step, got {of}")
    below = (value // of) * of
    above = below + of
    return [m for m in (below, above) if m > 0]


def format_choices(choices: Iterable[str]) -> str:
    """``'a', 'b', 'c'``: the allowed values of an option, quoted, in a stable order."""
    return ", ".join(repr(c) for c in sorted(choices))
