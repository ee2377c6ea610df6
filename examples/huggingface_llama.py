"""A Hugging Face Llama trained at data x tensor x pipeline parallelism, with no hook written.

    pip install "lightning-scale[hf]"
    python examples/huggingface_llama.py --dp 2 --tp 2 --pp 2         # 8 CPU processes
    python examples/huggingface_llama.py --tp 2 --pp 2 --max-steps 20  # 4 processes
    torchrun --nproc-per-node 8 examples/huggingface_llama.py --dp 2 --tp 2 --pp 2 --accelerator gpu

The LightningModule just wraps `LlamaForCausalLM` (random weights from a small config: nothing is
downloaded). `HybridParallelStrategy` finds what it needs in the model itself:

- tensor parallelism: the plan the model's config carries (transformers' `base_model_tp_plan`);
- pipeline parallelism: the model's own `nn.ModuleList` of decoder layers (Llama, Mistral, Qwen2
  and Qwen3 families), each stage running the model's own forward, the loss transformers' causal-LM
  loss. The batches here are `(input_ids, targets)` pairs with targets shifted by one token (the
  bundled text's); `{"input_ids", "labels"}` dicts work as well.

For pretrained weights, call `LlamaForCausalLM.from_pretrained(...)` instead of building it from a
config; `lightning-scale-ckpt consolidate` turns a checkpoint back into a Hugging Face model directory.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_scale.callbacks import ConsoleLogger
from lightning_scale.data import TextDataModule
from lightning_scale.strategies import HybridParallelStrategy


class LlamaModule(LightningModule):
    """Nothing here is specific to lightning-scale: the same module trains under any Lightning strategy."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=256,  # one token per byte of the bundled text
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,  # tensor_parallel must divide the heads ...
            num_key_value_heads=2,  # ... and the key/value heads
            max_position_embeddings=128,
        )
        self.model = LlamaForCausalLM(config)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        input_ids, targets = batch  # targets[:, t] is input_ids[:, t + 1]: already shifted
        logits = self.model(input_ids=input_ids).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    # At pipeline_parallel > 1 the strategy runs the model's stages instead of these steps and logs
    # the same loss as train/loss and val/loss.
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per layer (divides the heads)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (at most the number of layers)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--global-batch-size", type=int, default=16, help="sequences per step over all replicas")
    args = parser.parse_args()

    seed_everything(1234)
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.dp * args.tp * args.pp,
        strategy=HybridParallelStrategy(data_parallel=args.dp, tensor_parallel=args.tp, pipeline_parallel=args.pp),
        max_steps=args.max_steps,
        val_check_interval=args.max_steps,  # validate once, at the end
        check_val_every_n_epoch=None,
        limit_val_batches=4,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[ConsoleLogger(every_n_steps=max(args.max_steps // 5, 1))],
    )
    trainer.fit(LlamaModule(), datamodule=TextDataModule(seq_len=64, global_batch_size=args.global_batch_size))


if __name__ == "__main__":
    main()
