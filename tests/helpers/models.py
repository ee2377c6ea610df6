"""Small models of the user's own kind (not the reference GPT) that a pipeline can cut, and their modules."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_scale.core.pipeline.spec import PipelineSpec

__all__ = ["BlockStack", "ListStack", "StackModule", "TinyViT", "ViTModule", "lm_loss"]


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
        self.blocks = nn.ModuleDict(
            {str(i): b for i, b in enumerate(blocks if blocks is not None else [_mlp(dim) for _ in range(4)])}
        )
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


class TinyViT(nn.Module):
    """A timm-style vision transformer: ``cls_token`` and ``pos_embed`` are parameters of the model
    itself, outside every module a pipeline spec lists (``patch_embed``, ``blocks``, ``norm``, ``head``)."""

    def __init__(
        self,
        image: int = 8,
        patch: int = 4,
        channels: int = 3,
        dim: int = 32,
        depth: int = 4,
        classes: int = 10,
        count: bool = False,
    ) -> None:
        super().__init__()
        self.patch = patch
        # count: a buffer of the model itself that its forward updates (images seen), as running statistics are
        self.register_buffer("seen", torch.zeros((), dtype=torch.long) if count else None)
        self.patch_embed = nn.Linear(channels * patch * patch, dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.patch_embed is not None:  # images in; on later stages, the hidden state
            p = self.patch
            patches = x.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)
            x = self.patch_embed(patches)
            x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
            if self.seen is not None and self.training:
                self.seen += len(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0]) if self.head is not None else x


class ViTModule(LightningModule):
    """Image classification with :class:`TinyViT`, cut where timm's ViTs are cut."""

    def __init__(self, count: bool = False) -> None:
        super().__init__()
        self.vit = TinyViT(count=count)

    def pipeline_spec(self) -> tuple[str, PipelineSpec]:
        blocks = [f"blocks.{i}" for i in range(len(self.vit.blocks))]
        return "vit", PipelineSpec(
            blocks=blocks, first=["patch_embed"], last=["norm", "head"], loss_fn=nn.functional.cross_entropy
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.vit(batch[0]), batch[1])
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
