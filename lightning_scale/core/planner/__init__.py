"""The auto-parallel planner: memory, step time, throughput and cost of every layout before a run.

- :mod:`~lightning_scale.core.planner.cluster`: devices, links and cluster presets, each figure sourced;
- :mod:`~lightning_scale.core.planner.shape`: a decoder's shape from a ``GPTConfig`` or Hugging Face config;
- :mod:`~lightning_scale.core.planner.module_shape`: the same read off a module (built on the meta device);
- :mod:`~lightning_scale.core.planner.layout`: the workload and one candidate layout;
- :mod:`~lightning_scale.core.planner.memory` and :mod:`~lightning_scale.core.planner.step_time`: the
  estimates, term by term;
- :mod:`~lightning_scale.core.planner.search`: every admissible layout, estimated and ranked;
- :mod:`~lightning_scale.core.planner.sync`: a layout's step under Local SGD or DiLoCo, and the link speed
  below which they win;
- :mod:`~lightning_scale.core.planner.published` and :mod:`~lightning_scale.core.planner.measure`: the
  published measurements and the on-machine measurement the model is checked against.

Torch and the standard library only; it may import ``compat``, ``checks``, ``parallel``, ``pipeline``
and ``telemetry`` from ``core`` (it sits above them).
"""

from lightning_scale.core.planner.cluster import CLUSTERS, Cluster, cluster
from lightning_scale.core.planner.layout import Candidate, Workload
from lightning_scale.core.planner.module_shape import module_shape
from lightning_scale.core.planner.search import Estimate, candidates, estimate, plan
from lightning_scale.core.planner.shape import ModelShape, model_shape
from lightning_scale.core.planner.step_time import Efficiency
from lightning_scale.core.planner.sync import SyncEstimate, break_even, sync_time

__all__ = [
    "CLUSTERS",
    "Candidate",
    "Cluster",
    "Efficiency",
    "Estimate",
    "ModelShape",
    "SyncEstimate",
    "Workload",
    "break_even",
    "candidates",
    "cluster",
    "estimate",
    "model_shape",
    "module_shape",
    "plan",
    "sync_time",
]
