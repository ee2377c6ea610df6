"""Lightning strategies. Importing this registers ``"hybrid"``, ``"tensor_parallel"`` and ``"pipeline"``
with Lightning's ``StrategyRegistry`` (Lightning does not discover third-party strategies), and the model
families of :mod:`lightning_scale.integrations` (their plans and stages) the strategies find by model.
``import lightning_scale`` imports this once Lightning is imported too."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_scale import integrations as _integrations  # noqa: F401  (Hugging Face plans and stages)
from lightning_scale.core.parallel.sync_spec import SyncSpec, diloco, local_sgd, streaming_diloco
from lightning_scale.strategies.deepspeed import deepspeed_strategy
from lightning_scale.strategies.hybrid import TENSOR_PARALLEL_PLAN_HOOK, HybridParallelStrategy

if "hybrid" not in StrategyRegistry:
    HybridParallelStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "TENSOR_PARALLEL_PLAN_HOOK",
    "HybridParallelStrategy",
    "SyncSpec",
    "deepspeed_strategy",
    "diloco",
    "local_sgd",
    "streaming_diloco",
]
