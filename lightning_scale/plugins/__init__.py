"""Lightning plugins: precision (fp16 loss scaling decided once for the whole mesh, bf16 at every layout)."""

from lightning_scale.plugins.precision import MixedPrecision

__all__ = ["MixedPrecision"]
