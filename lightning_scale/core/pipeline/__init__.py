"""Pipeline parallelism over torch's ``torch.distributed.pipelining``: what a model declares and how
a stage is cut (:mod:`.spec`), cutting blocks into stages and the bubble (:mod:`.partition`,
:mod:`.block_costs`), schedules by name (:mod:`.schedules`), the rank's stages and their steps
(:mod:`.runner`), the micro-batch loss (:mod:`.loss`), weights tied across stages (:mod:`.ties`)
and timing inside the schedule (:mod:`.timing`).

May import: torch, the standard library, :mod:`lightning_scale.core.compat`,
:mod:`lightning_scale.core.checks` and :mod:`lightning_scale.core.parallel`.
"""
