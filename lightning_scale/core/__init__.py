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
  and ``checks``.
"""

from lightning_scale.core.checks import divisors, format_choices, suggest_multiples
from lightning_scale.core.lr_schedule import warmup_cosine

__all__ = ["divisors", "format_choices", "suggest_multiples", "warmup_cosine"]
