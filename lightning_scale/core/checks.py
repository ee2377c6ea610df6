"""Helpers that turn a broken rule into an error message that says how to fix it."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["divisors", "format_choices", "suggest_multiples"]


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
