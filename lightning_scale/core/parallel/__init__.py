"""The parallel layout and the transforms that apply it: how a world is cut into data, pipeline and
tensor groups (:mod:`.layout`), tensor-parallel plans (:mod:`.tensor_parallel`), data parallelism
(:mod:`.data_parallel`), per-block activation checkpointing and compile (:mod:`.blocks`), deferred
initialisation (:mod:`.deferred_init`), module-tree questions (:mod:`.modules`) and process groups
(:mod:`.groups`, :mod:`.process_groups`).

May import: torch, the standard library, :mod:`lightning_scale.core.compat` and
:mod:`lightning_scale.core.checks`.
"""
