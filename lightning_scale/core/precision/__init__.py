"""Numerics of the optimizer step: dynamic loss scaling for fp16 (:mod:`.loss_scaler`) and the global
gradient norm, clipping and overflow check over parameters that may be DTensors on several meshes
(:mod:`.grad_norm`).

May import: torch, the standard library, :mod:`lightning_scale.core.compat`,
:mod:`lightning_scale.core.checks` and :mod:`lightning_scale.core.parallel`.
"""
