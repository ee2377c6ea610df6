"""lightning-scale: hybrid data/tensor/pipeline parallelism, fault-tolerant checkpoints and cost
telemetry for PyTorch Lightning.

Importing the package registers its strategies with Lightning, so ``Trainer(strategy="hybrid")``
and ``Trainer(strategy="tensor_parallel")`` work after ``import lightning_scale``. It does so without
importing Lightning: the names are registered when Lightning is imported, before or after this package
(:mod:`lightning_scale._strategy_registration`), so a command that needs no Lightning (``lightning-scale-plan``,
``lightning-scale-ckpt``) never pays for importing it.
"""

import torch as _torch

from lightning_scale._torch_version import check_torch_version as _check_torch_version

_check_torch_version(str(_torch.__version__))

from lightning_scale._strategy_registration import register_strategies_with_lightning as _register  # noqa: E402

# "hybrid", "tensor_parallel", "pipeline" and the Hugging Face plans and stages the strategies find by model:
# now if Lightning is imported, else when it is.
_register()

__version__ = "0.2.0"
"""The release; ``pyproject.toml``'s ``version`` says the same (``tests/test_public_api.py`` checks)."""
__all__ = ["__version__"]
