"""``CostMonitor``: dollars, energy and the projection to ``max_steps`` (and to a target loss)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_scale.callbacks import _steps
from lightning_scale.callbacks import _telemetry as telemetry
from lightning_scale.core.telemetry.cost import CostMeter, device_offers, price_multiplier

__all__ = ["CostMonitor"]


class _Energy:
    """Joules this process's GPU used, from NVML's energy counter (``None`` where it cannot be read)."""

    def __init__(self, device: Any) -> None:
        self._handle = None
        self._last: float | None = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else 0
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._last = self._read()
        except Exception:  # no NVML library, no driver support (pre-Volta), or no permission
            self._handle = None

    def _read(self) -> float:
        import pynvml

        return pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1000.0  # mJ -> J

    @property
    def available(self) -> bool:
        return self._handle is not None

    def take(self) -> float | None:
        if self._handle is None:
            return None
        now = self._read()
        used, self._last = (now - self._last if self._last is not None else 0.0), now
        return used


class CostMonitor(telemetry.SharedTelemetry):
    """Log what the run costs: ``cost/usd`` (cumulative), ``cost/usd_per_1m_tokens``,
    ``cost/projected_usd`` and ``cost/projected_hours`` (at the recent step time, to ``max_steps``),
    ``cost/usd_to_target`` and ``cost/hours_to_target`` once ``target_loss`` is reached, and
    ``energy/kwh`` (``energy/co2_kg`` with a grid intensity) where NVML reads the GPUs' energy
    counters; where it cannot, energy is not reported. Totals are checkpointed and continue on resume.

    Time is wall time from the start of ``fit`` on every device of the world (validation and
    checkpointing included: the devices are paid for). Tokens are counted per data-parallel replica
    (every replica gets equal batches from Lightning's distributed sampler), without synchronisation;
    energy is summed over the processes in the logging step's one all-reduce (shared with the other
    telemetry callbacks).

    Args:
        price_per_device_hour: USD per device-hour, overriding the table
            (:data:`lightning_scale.core.telemetry.cost.PRICES`: public on-demand prices per device-hour, each
            dated and sourced, by chip and memory; alternatives in ``OFFERS`` are logged, not used).
        pricing: ``"on_demand"``, ``"spot"``, ``"reserved"`` (rough multipliers,
            :data:`lightning_scale.core.telemetry.cost.PRICING`) or a number multiplying the price.
        target_loss: record the cost and time at which ``monitor`` first reaches this value.
        monitor: the logged metric compared with ``target_loss`` (``val/...`` metrics are checked
            after each validation).
        grid_kg_co2_per_kwh: carbon intensity of the electricity, for ``energy/co2_kg``.
        batch_shape: ``batch -> (samples, tokens per sample)`` (see :class:`Throughput`).
    """

    def __init__(
        self,
        price_per_device_hour: float | None = None,
        *,
        pricing: str | float = "on_demand",
        target_loss: float | None = None,
        monitor: str = "train/loss",
        grid_kg_co2_per_kwh: float | None = None,
        batch_shape: Callable[[Any], tuple[int, int]] | None = None,
    ) -> None:
        for name, value in (
            ("price_per_device_hour", price_per_device_hour),
            ("grid_kg_co2_per_kwh", grid_kg_co2_per_kwh),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"{name}={value!r} must be a non-negative number (or None).")
        super().__init__()
        self.multiplier = price_multiplier(pricing)
        self.price_per_device_hour = price_per_device_hour
        self.target_loss = target_loss
        self.monitor = monitor
        self.grid = grid_kg_co2_per_kwh
        self.batch_shape = batch_shape
        self.meter = CostMeter(None)
        self._loaded: dict[str, Any] | None = None
        self._tokens = 0.0
        self._last_time: float | None = None
        self._last_step = 0
        self._seconds_per_step: float | None = None
        self._world: tuple[int, int] | None = None
        """(devices, data-parallel replicas) of the running fit."""

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.meter = CostMeter(self._price(trainer))
        self._energy = _Energy(trainer.strategy.root_device)
        if not self._energy.available:
            rank_zero_info(
                f"CostMonitor: energy is not reported (no NVML energy counter for {trainer.strategy.root_device.type})."
            )
        # Every rank enters the energy all-reduce or none does (once per fit: a rank without NVML, or
        # with a device it cannot read, would otherwise leave the others waiting in it).
        readable = telemetry.reduce_sum(trainer, [float(self._energy.available)])[0]
        self._energy_collective = readable > 0
        self._tokens = 0.0
        self._world = (trainer.world_size, telemetry.replicas(trainer))
        self._last_time, self._last_step = _steps.clock(), trainer.global_step

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Here: strategies that restore after set-up (HybridParallelStrategy) restore callbacks after on_fit_start.
        if self._loaded is not None:
            self.meter.load_state_dict(self._loaded)
            self._loaded = None

    def _price(self, trainer: Trainer) -> float | None:
        if self.price_per_device_hour is not None:
            return self.price_per_device_hour * self.multiplier
        name = telemetry.device_name(trainer)
        offers = device_offers(name)
        price = offers[0] if offers else None
        if price is None:
            # A CPU has no rental price to know: said, not warned (the default job runs on one).
            say = rank_zero_info if name == "cpu" else rank_zero_warn
            say(
                f"CostMonitor: no price is known for {name!r}, so cost/usd is not logged. Pass "
                "CostMonitor(price_per_device_hour=...) in USD per device-hour."
            )
            return None
        # Alternatives (other clouds) are shown, never used: the default is the documented one.
        others = "".join(f"; also {o.offer}: ${o.usd_per_device_hour:.3f}/device-hour ({o.date})" for o in offers[1:])
        rank_zero_info(
            f"CostMonitor: ${price.usd_per_device_hour:.3f}/device-hour x {self.multiplier} ({price.offer}, "
            f"{price.date}, {price.source}){others}."
        )
        return price.usd_per_device_hour * self.multiplier

    def _advance(self, trainer: Trainer) -> tuple[list[float], Callable[[list[float]], None]]:
        """Take the time and tokens since the last booking (and this process's energy, when every process
        reads it): the numbers to sum over the processes, and what books everything once they are summed."""
        now = _steps.clock()
        assert self._last_time is not None and self._world is not None
        seconds, steps = now - self._last_time, trainer.global_step - self._last_step
        if steps > 0:
            self._seconds_per_step = seconds / steps
        devices, tokens = self._world[0], self._tokens * self._world[1]
        self._tokens, self._last_time, self._last_step = 0.0, now, trainer.global_step
        if not self._energy_collective:
            return [], lambda _: self.meter.advance(seconds, devices, tokens)
        own = self._energy.take()

        def book(energy: list[float]) -> None:
            joules, readable = energy
            self.meter.advance(seconds, devices, tokens, joules if readable == devices else None)

        return [own or 0.0, float(own is not None)], book

    def _metrics(self, trainer: Trainer) -> dict[str, float]:
        return self.meter.metrics(
            steps_done=trainer.global_step,
            max_steps=trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None,
            devices=trainer.world_size,
            seconds_per_step=self._seconds_per_step,
            grid_kg_co2_per_kwh=self.grid,
        )

    def _check_target(self, trainer: Trainer) -> None:
        if self.target_loss is None:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None and float(value) <= self.target_loss:
            self.meter.reach_target(trainer.global_step)

    def _finish_logging_step(
        self, trainer: Trainer, book: Callable[[list[float]], None], energy: list[float]
    ) -> dict[str, float]:
        book(energy)
        self._check_target(trainer)
        return self._metrics(trainer)

    sizes = True

    @override
    def share_steps(self) -> bool:
        return self.batch_shape is None

    @override
    def record_options(self, trainer: Trainer) -> dict[str, Any]:
        return super().record_options(trainer) | {"shape_fn": self.batch_shape}

    @override
    def fold_steps(self, trainer: Trainer, pl_module: LightningModule, steps: Sequence[telemetry.Step]) -> None:
        self._tokens += sum(step.samples * step.seq_len for step in steps)

    @override
    def logging_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        energy, book = self._advance(trainer)
        telemetry.contribute(
            trainer,
            self,
            telemetry.Share(
                energy, "sum", lambda summed: self._finish_logging_step(trainer, book, summed), prog_bar=("cost/usd",)
            ),
        )

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not trainer.sanity_checking and self.monitor.startswith("val"):
            self._check_target(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        energy, book = self._advance(trainer)
        book(telemetry.reduce_sum(trainer, energy) if energy else [])  # every process alike
        telemetry.publish(trainer, self._metrics(trainer), prog_bar=("cost/usd",))
        self._last_time = self._world = None

    @override
    def state_dict(self) -> dict[str, Any]:
        # With the time and tokens since the last logging step, booked without a collective: Lightning
        # may ask for the state on one rank only. Energy since then is left out.
        meter = CostMeter(**self.meter.state_dict())
        if self._last_time is not None and self._world is not None:
            meter.advance(_steps.clock() - self._last_time, self._world[0], self._tokens * self._world[1])
        return meter.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)
