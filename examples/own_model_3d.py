"""Your own LightningModule trained at data x tensor x pipeline parallelism.

    python examples/own_model_3d.py --dp 2 --tp 2 --pp 2          # 8 CPU processes, started by Lightning
    python examples/own_model_3d.py --tp 2 --pp 2 --max-steps 20   # 4 processes
    python examples/own_model_3d.py                                # 1 process: the same model, unsplit
    torchrun --nproc-per-node 8 examples/own_model_3d.py --dp 2 --tp 2 --pp 2 --accelerator gpu

The model below is plain PyTorch (a small causal transformer on the bundled Shakespeare text, one
byte per token). Two methods of the LightningModule tell `HybridParallelStrategy` how to cut it:

- `tensor_parallel_plan`: which linear layers are split by columns and which by rows (the
  Megatron layout: one all-reduce per attention and per MLP sub-layer);
- `pipeline_spec`: the blocks the model may be cut between, what runs before the first block and
  after the last, and the loss the last stage computes.

Everything else is an ordinary LightningModule and an ordinary `Trainer`. Parameter names are the
same at every layout, so a checkpoint saved at one (dp, tp, pp) loads at any other.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn

from lightning_scale.callbacks import ConsoleLogger
from lightning_scale.core.pipeline.spec import PipelineSpec
from lightning_scale.data import TextDataModule
from lightning_scale.strategies import HybridParallelStrategy


class Block(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.attn_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        # `-1` heads, not `heads`: under tensor parallelism each rank holds heads / tp of them.
        q, k, v = (proj(h).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyLM(nn.Module):
    """Embeddings, a stack of blocks, a final norm and an output head.

    A pipeline stage is this module with the other stages' parts set to ``None``, so ``forward``
    skips what is missing: a later stage receives the hidden state instead of tokens.
    """

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:  # the first stage: tokens in
            x = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:  # only this stage's blocks
            x = block(x)
        if self.head is not None:  # the last stage: logits out
            x = self.head(self.norm(x))
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class MyLightningModule(LightningModule):
    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 4, seq_len: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = TinyLM(vocab=256, dim=dim, heads=heads, layers=layers, seq_len=seq_len)

    # --- the two hooks HybridParallelStrategy reads -------------------------------------------

    def tensor_parallel_plan(self, tp_size: int, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, str]:
        """Module names (relative to this LightningModule; ``*`` matches one segment) -> style."""
        if self.hparams.heads % tp_size:
            raise ValueError(
                f"heads={self.hparams.heads} is not divisible by tensor_parallel={tp_size}: pick a divisor."
            )
        return {
            "net.blocks.*.q": "colwise",  # each rank computes heads / tp of the heads ...
            "net.blocks.*.k": "colwise",
            "net.blocks.*.v": "colwise",
            "net.blocks.*.o": "rowwise",  # ... and the output projection sums them (one all-reduce)
            "net.blocks.*.up": "colwise",  # MLP: a column slice of the hidden layer per rank
            "net.blocks.*.down": "rowwise",
        }

    def pipeline_spec(self) -> tuple[str, PipelineSpec]:
        """The module whose forward runs a stage, and where it may be cut (names relative to it)."""
        blocks = [f"blocks.{i}" for i in range(self.hparams.layers)]
        return "net", PipelineSpec(blocks=blocks, first=["embed", "pos"], last=["norm", "head"], loss_fn=lm_loss)

    # --- an ordinary LightningModule ---------------------------------------------------------
    # At pipeline_parallel > 1 the strategy runs the schedule instead of these steps, computes
    # `lm_loss` on the last stage and logs it as train/loss and val/loss itself.

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = lm_loss(self.net(tokens), targets)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.log("val/loss", lm_loss(self.net(tokens), targets), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per layer")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved_1f1b, zbv, ...")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--global-batch-size", type=int, default=16, help="sequences per step over all replicas")
    args = parser.parse_args()

    seed_everything(1234)  # the same seed gives the same initial model at every layout
    module = MyLightningModule()
    datamodule = TextDataModule(seq_len=module.hparams.seq_len, global_batch_size=args.global_batch_size)
    strategy = HybridParallelStrategy(
        data_parallel=args.dp, tensor_parallel=args.tp, pipeline_parallel=args.pp, schedule=args.schedule
    )
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.dp * args.tp * args.pp,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=args.max_steps,  # validate once, at the end
        check_val_every_n_epoch=None,
        limit_val_batches=4,
        gradient_clip_val=1.0,  # by the norm over every shard and stage
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[ConsoleLogger(every_n_steps=max(args.max_steps // 5, 1))],
    )
    trainer.fit(module, datamodule=datamodule)


if __name__ == "__main__":
    main()
