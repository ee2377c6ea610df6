"""Compute-optimal sizing: the parameters and tokens a budget buys, by a Chinchilla scaling law. No Lightning.

A law ``L(N, D) = E + A / N^alpha + B / D^beta`` (loss after ``D`` training tokens of an ``N``-parameter
model) with training compute ``C = 6 N D`` is lowest at (Hoffmann et al. 2022, appendix D.2)::

    N = G (C / 6)^(beta / (alpha + beta)),   D = (C / 6)^(alpha / (alpha + beta)) / G,
    G = (alpha A / (beta B))^(1 / (alpha + beta))

Laws: :data:`BESIROGLU_2024` (the default: Besiroglu et al. 2024's refit of Hoffmann et al.'s data,
https://arxiv.org/abs/2404.10102), :data:`HOFFMANN_2022` (Approach 3 of
https://arxiv.org/abs/2203.15556), or one fitted to your own runs' losses (:func:`fit_law`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_scale.core.checks import check_positive_number

__all__ = ["BESIROGLU_2024", "HOFFMANN_2022", "LAWS", "ScalingLaw", "fit_law"]


@dataclass(frozen=True)
class ScalingLaw:
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str

    def loss(self, parameters: float, tokens: float) -> float:
        return self.E + self.A / parameters**self.alpha + self.B / tokens**self.beta

    def optimal(self, flops: float) -> tuple[float, float]:
        """``(parameters, tokens)`` with ``6 N D = flops`` and the least loss."""
        check_positive_number("flops", flops, unit="FLOPs")
        a, b = self.alpha, self.beta
        g = (a * self.A / (b * self.B)) ** (1 / (a + b))
        n = g * (flops / 6) ** (b / (a + b))
        return n, flops / (6 * n)


HOFFMANN_2022 = ScalingLaw(1.69, 406.4, 410.7, 0.34, 0.28, "Hoffmann et al. 2022, Approach 3 (arXiv 2203.15556)")
BESIROGLU_2024 = ScalingLaw(
    1.8172, 482.01, 2085.43, 0.3478, 0.3658, "Besiroglu et al. 2024, refit of Hoffmann et al.'s data (arXiv 2404.10102)"
)
LAWS = {"besiroglu2024": BESIROGLU_2024, "hoffmann2022": HOFFMANN_2022}


def fit_law(runs: Sequence[tuple[float, float, float]], *, delta: float = 1e-3) -> ScalingLaw:
    """A law fitted to ``(parameters, tokens, loss)`` of finished runs, as Hoffmann et al. fit theirs:
    the Huber loss (``delta``) of ``log`` predicted against ``log`` observed loss over ``log A``, ``log B``,
    ``log E``, ``alpha`` and ``beta``: evaluated on a grid, then minimised with L-BFGS from its best points.

    Needs at least five runs that differ in both parameters and tokens (five coefficients)."""
    if len(runs) < 5:
        raise ValueError(
            f"fit_law needs at least 5 runs (parameters, tokens, loss) to fit 5 coefficients; got {len(runs)}."
        )
    for n, d, loss in runs:
        for name, value in (("parameters", n), ("tokens", d), ("loss", loss)):
            check_positive_number(name, value)
    if len({r[0] for r in runs}) < 2 or len({r[1] for r in runs}) < 2:
        raise ValueError("fit_law needs runs of at least two model sizes and two token counts.")
    data = torch.tensor(runs, dtype=torch.float64)
    log_n, log_d, log_l = data[:, 0].log(), data[:, 1].log(), data[:, 2].log()

    def objective(x: torch.Tensor) -> torch.Tensor:
        """Huber loss of log predicted against log observed, for each row of ``x`` (log A, log B, log E, alpha, beta)."""
        log_a, log_b, log_e, alpha, beta = (x[..., i : i + 1] for i in range(5))
        predicted = torch.logsumexp(
            torch.stack([log_a - alpha * log_n, log_b - beta * log_d, log_e.expand(*x.shape[:-1], len(runs))]), dim=0
        )
        return torch.nn.functional.huber_loss(predicted, log_l.expand_as(predicted), delta=delta, reduction="none").sum(
            -1
        )

    # A grid first (Hoffmann et al.'s way: the objective has local minima), then L-BFGS from its best points.
    axes = [
        torch.arange(0.0, 25.1, 2.5),
        torch.arange(0.0, 25.1, 2.5),
        torch.arange(-1.0, 1.01, 0.5),
        torch.arange(0.1, 0.81, 0.1),
        torch.arange(0.1, 0.81, 0.1),
    ]
    grid = torch.cartesian_prod(*axes).to(torch.float64)
    starts = grid[objective(grid).argsort()[:8]]
    best: tuple[float, list[float]] | None = None
    for start in starts:
        x = start.clone().requires_grad_(True)
        optimizer = torch.optim.LBFGS(
            [x], max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-15, line_search_fn="strong_wolfe"
        )

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            value = objective(x)
            value.backward()
            return value

        optimizer.step(closure)
        value = float(objective(x.detach()))
        if math.isfinite(value) and (best is None or value < best[0]):
            best = (value, x.detach().tolist())
    assert best is not None
    log_a, log_b, log_e, alpha, beta = best[1]
    return ScalingLaw(math.exp(log_e), math.exp(log_a), math.exp(log_b), alpha, beta, f"fitted to {len(runs)} runs")
