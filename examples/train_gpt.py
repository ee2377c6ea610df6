"""Train the reference GPT on the bundled Shakespeare text with plain Lightning, no Hydra.

    python examples/train_gpt.py                         # 2 CPU processes (DDP over gloo)
    python examples/train_gpt.py --devices 1 --max-steps 50
    python examples/train_gpt.py --accelerator gpu --devices 8 --model gpt2-124m --seq-len 1024

The same job as `lightning-scale-train`, spelled out: a data module that splits each global
batch over the data-parallel ranks, a LightningModule, and an ordinary Trainer.
"""

from __future__ import annotations

import argparse

from lightning.pytorch import Trainer, seed_everything

from lightning_scale.callbacks import ConsoleLogger
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="a preset name (tiny, small, gpt2-124m, ...)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=16, help="over all data-parallel ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    seed_everything(1234)
    config = GPTConfig.from_preset(args.model)
    datamodule = TextDataModule(seq_len=args.seq_len, global_batch_size=args.global_batch_size)
    datamodule.check_data_parallel(args.devices)  # fail here, before processes start
    module = GPTLightningModule(config, learning_rate=args.lr, warmup_steps=min(30, args.max_steps))
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.max_steps,
        val_check_interval=min(100, args.max_steps),
        check_val_every_n_epoch=None,
        limit_val_batches=20,
        gradient_clip_val=1.0,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        callbacks=[ConsoleLogger(every_n_steps=max(args.max_steps // 12, 1))],
    )
    trainer.fit(module, datamodule=datamodule)


if __name__ == "__main__":
    main()
