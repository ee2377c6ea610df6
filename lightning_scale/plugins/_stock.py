"""Lightning's stock precision plugins, as the :class:`MixedPrecision` that does the same."""

from __future__ import annotations

from lightning.pytorch.plugins.precision import Precision

from lightning_scale.plugins.precision import MixedPrecision

__all__ = ["as_mesh_precision"]


def as_mesh_precision(plugin: Precision | None) -> MixedPrecision:
    """The :class:`MixedPrecision` that does what ``plugin`` (one of Lightning's stock plugins, which
    the Trainer builds from ``precision="..."``) asks for; ``ValueError`` for any other plugin."""
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision
    from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision

    if plugin is None or type(plugin) is Precision:
        return MixedPrecision("32-true")
    if isinstance(plugin, MixedPrecision):
        return plugin
    if type(plugin) is DoublePrecision:
        return MixedPrecision("64-true")
    if type(plugin) is HalfPrecision and plugin.precision == "bf16-true":
        return MixedPrecision("bf16-true")
    if type(plugin) is LightningMixedPrecision:
        if plugin.scaler is None:
            return MixedPrecision("bf16-mixed", device=plugin.device)
        scaler = plugin.scaler
        return MixedPrecision(
            "fp16-mixed",
            device=plugin.device,
            init_scale=float(scaler.get_scale()),
            growth_factor=float(scaler.get_growth_factor()),
            backoff_factor=float(scaler.get_backoff_factor()),
            growth_interval=int(scaler.get_growth_interval()),
        )
    valid = ", ".join(repr(p) for p in ("16-mixed", "bf16-mixed", "bf16-true", "32-true", "64-true"))
    raise ValueError(
        f"HybridParallelStrategy runs precision through lightning_scale.plugins.MixedPrecision (one overflow decision "
        f"for the whole mesh, applied inside pipeline schedules), and cannot use {type(plugin).__name__}"
        f"(precision={getattr(plugin, 'precision', None)!r}). Pass Trainer(precision=...) with one of {valid}, or "
        "plugins=[lightning_scale.plugins.MixedPrecision(...)]."
    )
