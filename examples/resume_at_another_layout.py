"""Train at one layout, stop, and resume at another from the same sharded checkpoints.

    python examples/resume_at_another_layout.py --dp 2 --max-steps 40   # 2 processes, data parallel
    python examples/resume_at_another_layout.py --pp 2 --max-steps 80   # 2 pipeline stages resume at step 40
    python examples/resume_at_another_layout.py --tp 2 --max-steps 120  # and tensor parallel from step 80
    lightning-scale-ckpt inspect ckpt/last.ckpt                          # layout, step, tensors by kind

Every rank writes its own shards (`ShardedCheckpointIO`, the strategy's default), and parameters
keep their names at every layout, so a checkpoint saved at one (dp, tp, pp) loads at any other:
model, optimizer state, loop counters and the position in the data (counted in global batches)
included, with no conversion step. `ckpt_path="latest"` takes the newest checkpoint in the
`ModelCheckpoint` directory that verifies (on the first run there is none: it starts from scratch,
with a warning).

The learning rate is constant here so that the two runs together follow the schedule of one; with
a warm-up and decay, give both runs the same schedule length.
"""

from __future__ import annotations

import argparse

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import LambdaCallback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from lightning_scale.callbacks import ConsoleLogger
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTLightningModule
from lightning_scale.plugins import ShardedCheckpointIO
from lightning_scale.strategies import HybridParallelStrategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per layer")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--max-steps", type=int, default=40, help="train until this optimizer step")
    parser.add_argument("--save-every", type=int, default=20, help="a checkpoint every this many steps")
    parser.add_argument("--ckpt-dir", default="ckpt")
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()

    seed_everything(1234)
    module = GPTLightningModule("tiny", learning_rate=3e-3, warmup_steps=0, min_lr_ratio=1.0)  # a constant LR
    strategy = HybridParallelStrategy(
        data_parallel=args.dp,
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        checkpoint_io=ShardedCheckpointIO(keep_last=2),  # the two newest checkpoints of this run stay
    )
    say_where = LambdaCallback(
        on_train_start=lambda trainer, _: rank_zero_info(
            f"training at dp={args.dp} tp={args.tp} pp={args.pp} from step {trainer.global_step} to {args.max_steps}"
        )
    )
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.dp * args.tp * args.pp,
        strategy=strategy,
        max_steps=args.max_steps,
        limit_val_batches=0,  # no validation: this example is about the checkpoints
        logger=False,
        enable_progress_bar=False,
        callbacks=[
            ModelCheckpoint(
                dirpath=args.ckpt_dir, every_n_train_steps=args.save_every, save_top_k=-1, save_last="link"
            ),
            ConsoleLogger(every_n_steps=max(args.save_every // 2, 1)),
            say_where,
        ],
    )
    datamodule = TextDataModule(seq_len=64, global_batch_size=8)
    trainer.fit(module, datamodule=datamodule, ckpt_path="latest")


if __name__ == "__main__":
    main()
