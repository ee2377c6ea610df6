"""Checkpoints on disk (``../shared/DESIGN.md``): the committed directory format and its manifest
(:mod:`.format`, :mod:`.commit`), which checkpoint ``"latest"`` names (:mod:`.latest`), checksums
(:mod:`.checksums`), reading and writing DCP shards safely (:mod:`.dcp_metadata`, :mod:`.saved_tensor`,
:mod:`.shard_reader`, :mod:`.shard_writer`, :mod:`.sharded`), async saves' host buffers
(:mod:`.host_staging`), non-tensor state as JSON (:mod:`.state`), whole-model states (:mod:`.full_state`),
a parallelised model's sharded state (:mod:`.sharded_state`) with tied weights stored once
(:mod:`.ties`), where files live (:mod:`.storage`) and how often to save (:mod:`.interval`).

May import: torch, the standard library, :mod:`lightning_scale.core.compat`,
:mod:`lightning_scale.core.checks` and :mod:`lightning_scale.core.parallel`.
"""
