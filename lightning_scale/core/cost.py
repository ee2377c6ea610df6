"""Dollars and energy of a training run: a price table and a meter. No Lightning.

Prices are public **on-demand** list prices per device-hour: a cloud instance's hourly price
divided by its accelerators (the host's CPUs, memory and disks are in it), in the region and on the
date each row names. They change and differ by region and contract: pass your own
(``price_per_device_hour``) for real budgets, and a multiplier for spot or reserved capacity.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from lightning_scale.core.peaks import chip_of

__all__ = ["PRICES", "PRICING", "CostMeter", "Price", "device_price", "price_multiplier"]


@dataclass(frozen=True)
class Price:
    chip: str
    usd_per_device_hour: float
    offer: str
    """The instance the figure comes from (price / accelerators)."""
    date: str
    source: str


_AWS = "https://aws.amazon.com/ec2/pricing/on-demand/ (us-east-1, Linux)"

PRICES: dict[str, Price] = {
    p.chip: p
    for p in (
        Price("H100 SXM", 98.32 / 8, "AWS p5.48xlarge, 8 GPUs at $98.32/h", "2024-06", _AWS),
        Price("A100", 32.7726 / 8, "AWS p4d.24xlarge, 8 GPUs at $32.7726/h", "2024-06", _AWS),
        Price("V100 SXM2", 3.06, "AWS p3.2xlarge, 1 GPU", "2024-06", _AWS),
        Price("L40S", 1.861, "AWS g6e.xlarge, 1 GPU", "2024-08", _AWS),
        Price("L4", 0.8048, "AWS g6.xlarge, 1 GPU", "2024-06", _AWS),
        Price("A10G", 1.006, "AWS g5.xlarge, 1 GPU", "2024-06", _AWS),
        Price("T4", 0.526, "AWS g4dn.xlarge, 1 GPU", "2024-06", _AWS),
    )
}

PRICING: dict[str, float] = {"on_demand": 1.0, "spot": 0.35, "reserved": 0.6}
"""Multipliers on the on-demand price. ``spot`` and ``reserved`` are rough planning figures (spot
prices float, commitments differ); pass a number for your own."""


def device_price(device_name: str) -> Price | None:
    """The table's price for a device of that name (``None``: no row; the caller asks for an override)."""
    chip = chip_of(device_name)
    return None if chip is None else PRICES.get(chip)


def price_multiplier(pricing: str | float) -> float:
    if isinstance(pricing, str):
        if pricing not in PRICING:
            raise ValueError(f"pricing={pricing!r} must be one of {sorted(PRICING)} or a positive number.")
        return PRICING[pricing]
    if isinstance(pricing, bool) or not isinstance(pricing, (int, float)) or not pricing > 0:
        raise ValueError(f"pricing={pricing!r} must be one of {sorted(PRICING)} or a positive number.")
    return float(pricing)


@dataclass
class CostMeter:
    """Accumulates device-seconds, tokens and energy; everything it reports follows from them and the
    price. Its state is plain numbers (:meth:`state_dict`), so totals survive a resume."""

    usd_per_device_hour: float | None
    device_seconds: float = 0.0
    wall_seconds: float = 0.0
    tokens: float = 0.0
    spent_usd: float = 0.0
    """Accumulated step by step at the price of the time: a resume at another price changes only what follows."""
    joules: float | None = None
    """``None``: energy could not be read (and is not reported)."""
    target_reached: dict[str, float] | None = None
    """``{"usd", "hours", "step"}`` when the target loss was first reached."""

    def advance(self, seconds: float, devices: int, tokens: float, joules: float | None = None) -> None:
        if seconds < 0 or devices < 1 or tokens < 0:
            raise ValueError(f"seconds={seconds}, devices={devices}, tokens={tokens}: none may be negative.")
        self.wall_seconds += seconds
        self.device_seconds += seconds * devices
        if self.usd_per_device_hour is not None:
            self.spent_usd += seconds * devices / 3600 * self.usd_per_device_hour
        self.tokens += tokens
        if joules is not None:
            self.joules = (self.joules or 0.0) + joules

    @property
    def usd(self) -> float | None:
        return None if self.usd_per_device_hour is None else self.spent_usd

    def metrics(self, *, steps_done: int, max_steps: int | None, devices: int, seconds_per_step: float | None,
                grid_kg_co2_per_kwh: float | None = None) -> dict[str, float]:
        """``cost/*`` and ``energy/*`` keys (only those that can be known), with the projection to
        ``max_steps`` at ``seconds_per_step``."""
        out: dict[str, float] = {}
        usd = self.usd
        remaining_s = None
        if max_steps and seconds_per_step is not None and max_steps >= steps_done:
            remaining_s = (max_steps - steps_done) * seconds_per_step
            out["cost/projected_hours"] = (self.wall_seconds + remaining_s) / 3600
        if usd is not None:
            out["cost/usd"] = usd
            if self.tokens > 0:
                out["cost/usd_per_1m_tokens"] = usd / self.tokens * 1e6
            if remaining_s is not None:
                out["cost/projected_usd"] = usd + remaining_s * devices / 3600 * self.usd_per_device_hour
        if self.target_reached is not None:
            out["cost/hours_to_target"] = self.target_reached["hours"]
            if "usd" in self.target_reached:
                out["cost/usd_to_target"] = self.target_reached["usd"]
        if self.joules is not None:
            kwh = self.joules / 3.6e6
            out["energy/kwh"] = kwh
            if grid_kg_co2_per_kwh is not None:
                out["energy/co2_kg"] = kwh * grid_kg_co2_per_kwh
        return out

    def reach_target(self, step: int) -> None:
        if self.target_reached is None:
            self.target_reached = {"hours": self.wall_seconds / 3600, "step": float(step)}
            if self.usd is not None:
                self.target_reached["usd"] = self.usd

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Totals from a checkpoint; the price stays this run's (it may have been overridden)."""
        for f in fields(self):
            if f.name != "usd_per_device_hour" and f.name in state:
                setattr(self, f.name, state[f.name])
