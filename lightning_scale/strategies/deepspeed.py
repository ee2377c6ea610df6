"""``deepspeed_strategy``: Lightning's ``DeepSpeedStrategy`` for GPU users, refused up front on CPU."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import Strategy

__all__ = ["DEEPSPEED_EQUIVALENT", "deepspeed_strategy"]

DEEPSPEED_EQUIVALENT = {1: "fsdp_grad_op", 2: "fsdp_grad_op", 3: "fsdp"}
"""The ``HybridParallelStrategy`` data-parallel mode that shards at least as much as each ZeRO stage."""


def deepspeed_strategy(stage: int = 2, **kwargs: Any) -> Strategy:
    """Lightning's ``DeepSpeedStrategy(stage=stage, **kwargs)``.

    DeepSpeed's Lightning strategy runs on CUDA GPUs only: without one this raises ``ValueError``
    before any process starts, naming the preset that does the same on CPU.
    """
    if stage not in DEEPSPEED_EQUIVALENT:
        raise ValueError(f"DeepSpeed ZeRO stage={stage!r} must be 1, 2 or 3.")
    if not torch.cuda.is_available():
        mode = DEEPSPEED_EQUIVALENT[stage]
        raise ValueError(
            f"strategy=deepspeed_zero{stage} uses Lightning's DeepSpeedStrategy, which needs CUDA GPUs; this machine "
            f"has none. On CPU use strategy=hybrid strategy.data_parallel_mode={mode} (FSDP2 sharding at least as "
            f"deep as ZeRO-{stage})."
        )
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return DeepSpeedStrategy(stage=stage, **kwargs)
