"""How often to checkpoint: Young's and Daly's optimal intervals. No Lightning.

With a checkpoint costing ``C`` seconds of lost training and failures arriving at a mean time
``M`` apart, checkpointing every ``T`` seconds wastes about ``C / T`` (saving) plus ``T / 2M``
(recomputing, on average, half an interval after each failure). Young (1974) minimises that:
``T = sqrt(2 C M)``. Daly (2006, "A higher order estimate of the optimum checkpoint interval for
restart dumps", FGCS 22) adds the restart and higher-order terms:
``T = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + C / 18M) - C`` for ``C < 2M``, else ``M``.
"""

from __future__ import annotations

import math

__all__ = ["daly_interval", "young_interval"]


def _check(cost_s: float, mtbf_s: float) -> None:
    if not (cost_s >= 0 and mtbf_s > 0):
        raise ValueError(f"cost_s={cost_s!r} must be >= 0 and mtbf_s={mtbf_s!r} > 0 (seconds).")


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that Young's first-order model finds optimal."""
    _check(cost_s, mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (seconds of training between checkpoints)."""
    _check(cost_s, mtbf_s)
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_s
