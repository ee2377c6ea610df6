"""Numerical health of a training run: non-finite values and loss spikes. No Lightning."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["HealthVerdict", "LossSpikeDetector"]


@dataclass(frozen=True)
class HealthVerdict:
    healthy: bool
    reason: str = ""
    zscore: float | None = None


class LossSpikeDetector:
    """Flags a non-finite loss or gradient norm, and a loss more than ``zscore`` standard deviations
    above the mean of the last ``window`` healthy losses (once ``min_history`` are in; only upward
    spikes). Flagged losses do not enter the window, so one spike does not hide the next."""

    def __init__(self, window: int = 100, zscore: float = 6.0, min_history: int = 20) -> None:
        if not (isinstance(window, int) and window >= 2):
            raise ValueError(f"window={window!r} must be an integer >= 2 (losses the mean and spread are taken over).")
        if not (isinstance(zscore, (int, float)) and zscore > 0):
            raise ValueError(f"zscore={zscore!r} must be a positive number of standard deviations.")
        if not (isinstance(min_history, int) and 2 <= min_history <= window):
            raise ValueError(f"min_history={min_history!r} must be an integer between 2 and window={window}.")
        self.zscore, self.min_history = float(zscore), min_history
        self.history: deque[float] = deque(maxlen=window)

    def check(self, loss: float, grad_norm: float | None = None) -> HealthVerdict:
        if not math.isfinite(loss):
            return HealthVerdict(False, f"non-finite loss ({loss})")
        if grad_norm is not None and not math.isfinite(grad_norm):
            return HealthVerdict(False, f"non-finite gradient norm ({grad_norm})")
        z = None
        if len(self.history) >= self.min_history:
            n = len(self.history)
            mean = sum(self.history) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / (n - 1))
            z = (loss - mean) / std if std > 0 else (0.0 if loss <= mean else math.inf)
            if z > self.zscore:
                return HealthVerdict(
                    False,
                    f"loss spike: {loss:.4g} is {z:.1f} standard deviations above the mean {mean:.4g} of the "
                    f"last {n} steps (threshold {self.zscore:g})",
                    z,
                )
        self.history.append(loss)
        return HealthVerdict(True, zscore=z)

    def state_dict(self) -> dict[str, object]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.history.clear()
        self.history.extend(float(x) for x in state.get("history", []))  # type: ignore[union-attr]
