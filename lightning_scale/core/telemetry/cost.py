"""Dollars and energy of a training run: a price table and a meter. No Lightning.

Prices are public **on-demand** list prices per device-hour: a cloud instance's hourly price
divided by its accelerators (the host's CPUs, memory and disks are in it), in the region and on the
date each row names. Chips trained on in nodes of eight are priced from the 8-GPU instance people rent
(a 1-GPU instance of the same chip costs less per GPU than the node); chips rented one at a time
(L4, L40S, A10G, T4) from their 1-GPU instance, and say so. Prices change and differ by region,
provider and contract: pass your own (``price_per_device_hour``) for real budgets, and a multiplier
for spot or reserved capacity.

:data:`OFFERS` lists every offer per device (the default first, then alternatives from other
clouds); :data:`PRICES` and :func:`device_price` give the default. A device is keyed by its chip and,
where the price differs by it, its memory (``"A100 40GB"``, ``"A100 80GB"``): :func:`price_key`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from lightning_scale.core.telemetry.peaks import chip_of

__all__ = [
    "OFFERS",
    "PRICES",
    "PRICING",
    "CostMeter",
    "Price",
    "device_offers",
    "device_price",
    "price_key",
    "price_multiplier",
]


@dataclass(frozen=True)
class Price:
    chip: str
    """The price key: the chip, with its memory where offers differ by it (``"A100 80GB"``)."""
    usd_per_device_hour: float
    offer: str
    """The instance the figure comes from (its hourly price / its accelerators)."""
    date: str
    """``YYYY-MM``: the month from which the source shows this price (for AWS P4/P5 instances, their
    June 2025 on-demand cut; else the earliest dated reading)."""
    source: str
    """URL of the price, and where it was read."""


_AWS = "https://aws.amazon.com/ec2/pricing/on-demand/ (us-east-1, Linux)"
_SKY = "https://raw.githubusercontent.com/skypilot-org/skypilot-catalog/master/catalogs/v8"
_AWS_CUT = (
    f"{_AWS}; the price since AWS's June 2025 on-demand cut for P4/P5 instances, read in "
    f"{_SKY}/aws/vms.csv (snapshot read 2026-12)"
)
_AWS_READ = f"{_AWS}; the same price read in {_SKY}/aws/vms.csv (snapshot read 2026-12)"
_LAMBDA = (
    f"{_SKY}/lambda/vms.csv (Lambda's on-demand list, https://lambda.ai/instances, in an undated "
    "SkyPilot catalog snapshot read 2026-12; not confirmed on lambda.ai itself)"
)

OFFERS: dict[str, tuple[Price, ...]] = {}
"""Every offer per price key, the default (AWS us-east-1) first."""
for _p in (
    Price("H100 SXM", 55.04 / 8, "AWS p5.48xlarge, 8x H100 80GB at $55.04/h", "2025-06", _AWS_CUT),
    Price("H100 SXM", 31.92 / 8, "Lambda gpu_8x_h100_sxm5, 8x H100 SXM 80GB at $31.92/h", "2026-12", _LAMBDA),
    Price(
        "H200 SXM",
        63.296 / 8,
        "AWS p5en.48xlarge, 8x H200 141GB at $63.296/h (p5e.48xlarge lists no on-demand price)",
        "2025-06",
        _AWS_CUT + "; the same price in https://github.com/dstackai/dstack/pull/4110 (2026-08)",
    ),
    Price("A100 80GB", 27.44705 / 8, "AWS p4de.24xlarge, 8x A100 80GB at $27.44705/h", "2025-06", _AWS_CUT),
    Price("A100 80GB", 22.32 / 8, "Lambda gpu_8x_a100_80gb_sxm4, 8x A100 SXM 80GB at $22.32/h", "2026-12", _LAMBDA),
    Price("A100 40GB", 21.957642 / 8, "AWS p4d.24xlarge, 8x A100 40GB at $21.957642/h", "2025-06", _AWS_CUT),
    Price("A100 40GB", 15.92 / 8, "Lambda gpu_8x_a100, 8x A100 40GB at $15.92/h", "2026-12", _LAMBDA),
    Price("B200", 113.9328 / 8, "AWS p6-b200.48xlarge, 8x B200 at $113.9328/h", "2026-12", _AWS_READ),
    Price("B200", 53.52 / 8, "Lambda gpu_8x_b200_sxm6, 8x B200 at $53.52/h", "2026-12", _LAMBDA),
    Price("V100 SXM2 16GB", 24.48 / 8, "AWS p3.16xlarge, 8x V100 16GB at $24.48/h", "2026-12", _AWS_READ),
    Price("V100 SXM2 32GB", 31.212 / 8, "AWS p3dn.24xlarge, 8x V100 32GB at $31.212/h", "2026-12", _AWS_READ),
    Price(
        "L40S",
        1.861,
        "AWS g6e.xlarge, a 1-GPU instance (L40S is rented singly)",
        "2024-08",
        f"{_AWS}; from the 2024-08 table, not re-read in the 2026 snapshot",
    ),
    Price("L4", 0.8048, "AWS g6.xlarge, a 1-GPU instance (L4 is rented singly)", "2024-06", _AWS_READ),
    Price("A10G", 1.006, "AWS g5.xlarge, a 1-GPU instance (A10G is rented singly)", "2024-06", _AWS_READ),
    Price("T4", 0.526, "AWS g4dn.xlarge, a 1-GPU instance (T4 is rented singly)", "2024-06", _AWS_READ),
):
    OFFERS[_p.chip] = (*OFFERS.get(_p.chip, ()), _p)
del _p

PRICES: dict[str, Price] = {key: offers[0] for key, offers in OFFERS.items()}
"""The default offer per price key (what :func:`device_price` returns)."""

# Chips whose offers differ by memory: the sizes a device name spells (``NVIDIA A100-SXM4-80GB``).
_MEMORY: dict[str, tuple[str, ...]] = {"A100": ("40GB", "80GB"), "V100 SXM2": ("16GB", "32GB")}


def price_key(device_name: str) -> str | None:
    """The price table's key for a device name: its chip, and its memory where prices differ by it
    (``"NVIDIA A100-SXM4-80GB"`` -> ``"A100 80GB"``). None: unknown chip, or a chip priced by memory
    whose name gives none (no guess between a 40GB and an 80GB price)."""
    chip = chip_of(device_name)
    if chip is None or chip not in _MEMORY:
        return chip
    name = device_name.upper().replace(" ", "")
    return next((f"{chip} {size}" for size in _MEMORY[chip] if size in name), None)


def device_offers(device_name: str) -> tuple[Price, ...]:
    """Every offer in the table for a device of that name, the default first (empty: no row)."""
    key = price_key(device_name)
    return () if key is None else OFFERS.get(key, ())


def device_price(device_name: str) -> Price | None:
    """The table's default price for a device of that name (``None``: no row; the caller asks for an override)."""
    offers = device_offers(device_name)
    return offers[0] if offers else None


PRICING: dict[str, float] = {"on_demand": 1.0, "spot": 0.35, "reserved": 0.6}
"""Multipliers on the on-demand price. ``spot`` and ``reserved`` are rough planning figures (spot
prices float, commitments differ); pass a number for your own."""


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

    def metrics(
        self,
        *,
        steps_done: int,
        max_steps: int | None,
        devices: int,
        seconds_per_step: float | None,
        grid_kg_co2_per_kwh: float | None = None,
    ) -> dict[str, float]:
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
