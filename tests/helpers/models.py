"""A small model of the user's own kind (not the reference GPT) that a pipeline can cut, and its module."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_scale.core.pipeline import PipelineSpec

__all__ = ["BlockStack", "ListStack", "StackModule", "lm_loss"]


def lm_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def _mlp(dim: int) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))


class BlockStack(nn.Module):
    """Token embedding, residual blocks in an ``nn.ModuleDict`` (default: 4 MLPs), output head. Its
    ``forward`` skips the modules a pipeline stage removed."""

    def __init__(self, blocks: Sequence[nn.Module] | None = None, dim: int = 32, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleDict({str(i): b for i, b in enumerate(blocks if blocks is not None else [_mlp(dim) for _ in range(4)])})
        self.out = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = x + block(x)
        return self.out(x) if self.out is not None else x


class ListStack(BlockStack):
    """The same, with its blocks in an ``nn.ModuleList`` (as Hugging Face, litgpt and timm keep theirs)."""

    def __init__(self, dim: int = 32, vocab: int = 256, depth: int = 4) -> None:
        super().__init__(dim=dim, vocab=vocab)
        self.blocks = nn.ModuleList(_mlp(dim) for _ in range(depth))  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x) if self.out is not None else x


class StackModule(LightningModule):
    """A LightningModule written as a user would, declaring its blocks through the ``pipeline_spec`` hook."""

    def __init__(self, net: BlockStack | None = None) -> None:
        super().__init__()
        self.net = net if net is not None else BlockStack()

    def pipeline_spec(self) -> tuple[str, PipelineSpec]:
        blocks = [f"blocks.{k}" for k in self.net.blocks._modules]  # "0", "1", ... in a ModuleDict or a ModuleList
        return "net", PipelineSpec(blocks=blocks, first=["embed"], last=["out"], loss_fn=lm_loss)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.net(batch[0]), batch[1])
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.net(batch[0]), batch[1])
        self.log("val/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)
