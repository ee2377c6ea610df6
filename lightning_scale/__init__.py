"""lightning-scale: hybrid data/tensor/pipeline parallelism, fault-tolerant checkpoints and cost
telemetry for PyTorch Lightning.

Importing the package registers its strategies with Lightning, so ``Trainer(strategy="hybrid")``
and ``Trainer(strategy="tensor_parallel")`` work after ``import lightning_scale``.
"""

import torch as _torch

from lightning_scale._torch_version import check_torch_version as _check_torch_version

_check_torch_version(str(_torch.__version__))

from lightning_scale import integrations as _integrations  # noqa: E402, F401  (Hugging Face plans and stages)
from lightning_scale import strategies as _strategies  # noqa: E402, F401  (registers "hybrid", "tensor_parallel")

__version__ = "0.1.0"
__all__ = ["__version__"]
