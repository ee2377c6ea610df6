"""Learning-rate schedules as pure functions of the step, so they can be checked number by number."""

from __future__ import annotations

import math

__all__ = ["warmup_cosine"]


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Linear warm-up from ``1/warmup_steps`` to 1 over the first ``warmup_steps`` steps (step 0 does
    not train at a learning rate of exactly 0), then a half cosine from 1 down to ``min_ratio`` at
    ``total_steps``; constant ``min_ratio`` afterwards.
    """
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(
            f"warmup_cosine needs warmup_steps >= 0 and total_steps >= 1, got {warmup_steps} and {total_steps}"
        )
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must lie in [0, 1], got {min_ratio}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
