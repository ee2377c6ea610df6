"""Math and mechanisms with no Lightning in them, by mechanism.

Only ``torch`` and the standard library may be imported here, so everything in this package can be
tested without a Trainer (and most of it without a process group). The sub-packages and what each
may import from the package (``tests/test_layering.py`` enforces both, and that no import cycle
exists anywhere in ``lightning_scale``):

- :mod:`~lightning_scale.core.compat` (every private torch API the package uses, one shim each,
  checked by a canary in ``tests/test_compat.py``): nothing; every other part may import it;
  :mod:`~lightning_scale.core.compat_c10d` (the same for c10d's store and flight recorder): ``compat``;
- :mod:`~lightning_scale.core.checks` (validators that name the rule and the fix) and
  :mod:`~lightning_scale.core.lr_schedule` (the learning-rate schedule): ``compat``;
- :mod:`~lightning_scale.core.parallel` (the mesh layout, tensor and data parallelism, per-block
  transforms, deferred initialisation, process groups): ``compat`` and ``checks``;
- :mod:`~lightning_scale.core.pipeline` (stage specs, partition, schedules, the runner, the loss,
  tied weights, timing), :mod:`~lightning_scale.core.checkpoint` (the directory format, DCP reading
  and writing, checksums, JSON state, storage), :mod:`~lightning_scale.core.precision` (loss
  scaling, gradient norms over meshes) and :mod:`~lightning_scale.core.telemetry` (FLOPs, model
  facts, peaks, prices, numerical health): ``compat``, ``checks`` and ``parallel``, never each other;
- :mod:`~lightning_scale.core.planner` (memory, step time and cost of every layout before a run): any
  of the parts above but ``checkpoint`` and ``precision``;
- :mod:`~lightning_scale.core.resilience` (the hang watchdog and its report, the straggler action): ``compat``, ``compat_c10d``
  and ``checks``;
- :mod:`~lightning_scale.core.deprecation` (old import paths kept working, with a warning, for a release):
  nothing; a leaf like ``compat``, which any part may declare.

The modules ``core`` held before it was grouped by mechanism (``lightning_scale.core.checksums`` and the
like, 0.1.0) still import, with a ``DeprecationWarning`` naming the new module, until 0.3.0.
"""

from lightning_scale.core.checks import divisors, format_choices, suggest_multiples
from lightning_scale.core.deprecation import moved_modules
from lightning_scale.core.lr_schedule import warmup_cosine

__all__ = ["divisors", "format_choices", "suggest_multiples", "warmup_cosine"]

_CHECKPOINT, _PARALLEL, _PIPELINE = (
    "lightning_scale.core.checkpoint",
    "lightning_scale.core.parallel",
    "lightning_scale.core.pipeline",
)
_PRECISION, _TELEMETRY = "lightning_scale.core.precision", "lightning_scale.core.telemetry"

moved_modules(
    __name__,
    {
        # 0.1.0's flat core -> the part of each mechanism (the names they exported kept theirs).
        "block_costs": (f"{_PIPELINE}.block_costs",),
        "checkpoint_commit": (f"{_CHECKPOINT}.commit",),
        "checkpoint_format": (
            f"{_CHECKPOINT}.format",
            f"{_CHECKPOINT}.commit",
            f"{_CHECKPOINT}.checksums",
            f"{_CHECKPOINT}.latest",
        ),
        "checkpoint_interval": (f"{_CHECKPOINT}.interval",),
        "checkpoint_state": (f"{_CHECKPOINT}.state",),
        "checksums": (f"{_CHECKPOINT}.checksums",),
        "cost": (f"{_TELEMETRY}.cost",),
        "data_parallel": (f"{_PARALLEL}.data_parallel", f"{_PARALLEL}.blocks"),
        "dcp_metadata": (f"{_CHECKPOINT}.dcp_metadata",),
        "deferred_init": (f"{_PARALLEL}.deferred_init",),
        "flops": (f"{_TELEMETRY}.flops",),
        "full_state": (f"{_CHECKPOINT}.full_state",),
        "grad_norm": (f"{_PRECISION}.grad_norm",),
        "health": (f"{_TELEMETRY}.health",),
        "layout": (f"{_PARALLEL}.layout",),
        "loss_scaler": (f"{_PRECISION}.loss_scaler",),
        "model_facts": (f"{_TELEMETRY}.model_facts",),
        "modules": (f"{_PARALLEL}.modules",),
        "partition": (f"{_PIPELINE}.partition",),
        "peaks": (f"{_TELEMETRY}.peaks",),
        "pipeline_loss": (f"{_PIPELINE}.loss",),
        "pipeline_runner": (f"{_PIPELINE}.runner",),
        "pipeline_schedules": (f"{_PIPELINE}.schedules",),
        "pipeline_ties": (f"{_PIPELINE}.ties",),
        "pipeline_timing": (f"{_PIPELINE}.timing",),
        "process_groups": (f"{_PARALLEL}.process_groups",),
        "saved_tensor": (f"{_CHECKPOINT}.saved_tensor",),
        "schedules": ("lightning_scale.core.lr_schedule",),
        "shard_reader": (f"{_CHECKPOINT}.shard_reader",),
        "shard_writer": (f"{_CHECKPOINT}.shard_writer",),
        "sharded_checkpoint": (f"{_CHECKPOINT}.sharded", f"{_PARALLEL}.groups"),
        "storage": (f"{_CHECKPOINT}.storage",),
        "tensor_parallel": (f"{_PARALLEL}.tensor_parallel", f"{_PARALLEL}.modules"),
    },
    renamed={"data_parallel": {"bf16_compress_hook": f"{_PARALLEL}.data_parallel.bf16_all_reduce_hook"}},
)
