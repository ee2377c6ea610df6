"""The DeepSpeed peer of benchmarks/pipeline.py: the reference GPT as a DeepSpeed ``PipelineModule``.

DeepSpeed is optional (``pip install -c constraints.txt deepspeed``, the ``deepspeed`` extra). On a
CPU-only machine it runs with ``DS_ACCELERATOR=cpu`` over the gloo process group the benchmark
already opened; the first run JIT-compiles DeepSpeed's small shared-memory comm op (needs a C++
compiler and ninja, about a minute, cached under ``~/.cache/torch_extensions`` afterwards).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_scale.models import GPT, GPTConfig, language_model_loss

__all__ = ["DeepSpeedPipeline"]


class _Embed(nn.Module):
    """What runs before the first block: token (and learned position) embeddings."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(tokens.size(1), device=tokens.device))
        return self.drop(x)


class _Head(nn.Module):
    """What runs after the last block: final norm and output head."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.norm, self.head = gpt.norm, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


class DeepSpeedPipeline:
    """``PipelineModule([embed, *blocks, head], num_stages=world, partition_method="uniform")`` trained
    with ``engine.train_batch``: ``microbatches`` micro-batches of ``batch / microbatches`` samples
    (DeepSpeed's ``gradient_accumulation_steps``) per step, then the optimizer step.

    With the embedding and the head counted as layers, ``uniform`` puts the same blocks on each stage
    as ``partition_by_layers`` does (checked: ``blocks_per_stage``).
    """

    def __init__(
        self,
        config: GPTConfig,
        world: int,
        microbatches: int,
        batch: tuple[torch.Tensor, torch.Tensor],
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    ) -> None:
        if config.positional != "learned" or config.tie_embeddings:
            raise ValueError("The DeepSpeed peer cuts an untied GPT with learned positions only.")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        from deepspeed.pipe import PipelineModule
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        torch.manual_seed(0)
        gpt = GPT(config)
        layers = [_Embed(gpt), *gpt.blocks.values(), _Head(gpt)]
        # DeepSpeed prints its comm op build and partition table; the benchmark's last line is its report.
        with contextlib.redirect_stdout(io.StringIO()):
            deepspeed.init_distributed(dist_backend="gloo")  # reuses the open process group
            module = PipelineModule(
                layers=layers, num_stages=world, loss_fn=language_model_loss, partition_method="uniform"
            )
        self.blocks_per_stage = [
            sum(isinstance(layer, type(layers[1])) for layer in layers[a:b])
            for a, b in itertools.pairwise(module.parts)
        ]
        inputs, target = batch
        size = inputs.size(0) // microbatches
        ds_config = {
            "train_batch_size": inputs.size(0),
            "train_micro_batch_size_per_gpu": size,
            "gradient_accumulation_steps": microbatches,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, *_ = deepspeed.initialize(model=module, optimizer=make_optimizer(module), config=ds_config)
        chunks = [(inputs[i : i + size], target[i : i + size]) for i in range(0, inputs.size(0), size)]
        self._data: Iterator[Any] = itertools.cycle(chunks)
        self.version = deepspeed.__version__

    def step(self) -> float:
        """One training step (every micro-batch forward and backward, then AdamW); the mean loss."""
        return float(self.engine.train_batch(self._data))
