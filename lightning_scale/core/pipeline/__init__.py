"""Pipeline parallelism over torch's ``torch.distributed.pipelining``: what a model declares and how
a stage is cut (:mod:`.spec`), cutting blocks into stages and the bubble (:mod:`.partition`,
:mod:`.block_costs`), schedules by name (:mod:`.schedules`), the rank's stages and their steps
(:mod:`.runner`), the micro-batch loss (:mod:`.loss`), weights tied across stages (:mod:`.ties`)
and timing inside the schedule (:mod:`.timing`).

May import: torch, the standard library, :mod:`lightning_scale.core.compat`,
:mod:`lightning_scale.core.checks`, :mod:`lightning_scale.core.parallel` and
:mod:`lightning_scale.core.deprecation`.
"""

from lightning_scale.core.deprecation import moved_names

# 0.1.0's lightning_scale/core/pipeline.py became this package; its names live in .spec now.
__getattr__ = moved_names(
    __name__,
    {
        name: f"{__name__}.spec.{name}"
        for name in (
            "IGNORE_INDEX",
            "KeptModuleList",
            "PipelineSpec",
            "StageForward",
            "find_registered_spec",
            "labelled_tokens",
            "prune_to_stage",
            "register_pipeline_spec",
            "removed_module_called",
            "removed_modules",
            "stage_view",
            "undeclared_buffers",
            "undeclared_parameters",
            "with_registered_forward",
        )
    },
)
