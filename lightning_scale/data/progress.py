"""Deprecated: :class:`LoaderBatchProgress` is a callback and lives in
:mod:`lightning_scale.callbacks.loader_progress` (the old path goes in 0.3.0)."""

from lightning_scale.core.deprecation import moved_names

__all__: list[str] = []

__getattr__ = moved_names(
    __name__, {"LoaderBatchProgress": "lightning_scale.callbacks.loader_progress.LoaderBatchProgress"}
)
