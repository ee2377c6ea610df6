"""``GPTLightningModule``: the reference GPT with AdamW and a warm-up + cosine schedule."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_scale._lightning_compat import attached_trainer, set_initial_hparam, should_update_logs
from lightning_scale.core.lr_schedule import warmup_cosine
from lightning_scale.models.gpt import GPT, GPTConfig
from lightning_scale.models.parallel import language_model_loss

__all__ = ["GPTLightningModule"]

Batch = tuple[torch.Tensor, torch.Tensor]


def _adamw_fused(params: Iterable[torch.Tensor], *, device: torch.device | str | None = None) -> bool | None:
    """AdamW's ``fused`` argument for ``params``: True when every one is a floating-point tensor on a CUDA
    device (one fused kernel per step instead of the foreach kernels, torch's default there); otherwise None,
    torch's own choice (unchanged on the CPU). ``device``: take it as every parameter's device (a DTensor's
    is its mesh's), to decide for a model before it is moved."""
    params = list(params)
    if not params:
        return None
    for param in params:
        where = torch.device(device) if device is not None else param.device
        if where.type != "cuda" or not param.is_floating_point():
            return None
    return True


class GPTLightningModule(LightningModule):
    """Next-token language modelling on ``(inputs, targets)`` batches of token ids.

    Args:
        config: a :class:`GPTConfig`, a mapping of its fields, or a preset name.
        learning_rate: peak learning rate, reached after ``warmup_steps``.
        weight_decay: AdamW decoupled weight decay, applied to matrices only, not to norms or
            biases.
        betas, eps: AdamW moments. On CUDA (every parameter a floating-point CUDA tensor) AdamW runs
            fused (``fused=True``); elsewhere torch's default.
        warmup_steps: linear warm-up length in optimizer steps.
        min_lr_ratio: the cosine decays to ``min_lr_ratio * learning_rate`` at the last step
            (``Trainer.estimated_stepping_batches``).
        deferred_init: build the GPT in ``configure_model`` instead of here. Under
            ``HybridParallelStrategy`` it is then created on the meta device, cut and sharded, and each
            rank initialises only its own part (for models bigger than one device); the same seed gives
            the same parameters at every layout. Other strategies create it on their device as usual.
    """

    def __init__(
        self,
        config: GPTConfig | Mapping[str, Any] | str = "tiny",
        *,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        deferred_init: bool = False,
    ) -> None:
        super().__init__()
        config = GPTConfig.coerce(config)
        if learning_rate <= 0:
            raise ValueError(f"learning_rate must be positive, got {learning_rate}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if len(betas) != 2:
            raise ValueError(f"betas must be two numbers (beta1, beta2), got {list(betas)}")
        # Plain floats whatever the sequence (a Hydra ListConfig, a tensor): save_hyperparameters stores the
        # value as given, and a checkpoint holding another type does not load with weights_only=True.
        betas = (float(betas[0]), float(betas[1]))
        # Hyperparameters go into checkpoints as plain data so `load_from_checkpoint` rebuilds the model.
        self.save_hyperparameters(ignore=["config"])
        self.hparams["config"] = dataclasses.asdict(config)
        set_initial_hparam(self, "config", dataclasses.asdict(config))  # what loggers record
        self.config = config
        self.model: GPT | None = None if deferred_init else GPT(config)

    @override
    def configure_model(self) -> None:
        # Called by every Trainer call; the model is built once.
        if self.model is None:
            self.model = GPT(self.config)

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens)

    @property
    def gpt(self) -> GPT:
        if self.model is None:
            raise RuntimeError(
                "GPTLightningModule(deferred_init=True) builds its model in configure_model(), which the Trainer "
                "calls at the start of fit/validate/test/predict; call it yourself to use the module outside one."
            )
        return self.model

    @override
    def setup(self, stage: str) -> None:
        seq_len = getattr(self.trainer.datamodule, "seq_len", None) if attached_trainer(self) is not None else None
        if seq_len is not None and seq_len > self.config.block_size:
            raise ValueError(
                f"data seq_len={seq_len} exceeds the model's context block_size={self.config.block_size}. "
                f"Lower data.seq_len to at most {self.config.block_size} or raise model.block_size."
            )

    def _loss(self, batch: Batch) -> torch.Tensor:
        tokens, targets = batch
        # Under loss parallelism the logits are a DTensor sharded on the vocabulary and the
        # strategy runs this under `loss_parallel()`: cross entropy without gathering the logits.
        loss = language_model_loss(self(tokens), targets)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        trainer = self.trainer
        last = 0 < trainer.max_steps <= trainer.global_step + 1
        if should_update_logs(trainer) or last:
            # Logged at the loggers' steps only, as the mean over the whole global batch (not rank 0's
            # share), so curves at different data-parallel sizes are comparable: one scalar all-reduce
            # there, none on the steps between (sync_dist=True would reduce on every step).
            mean = trainer.strategy.reduce(loss.detach().clone(), reduce_op="mean")
            # On the progress bar only when there is one: Lightning reads its values on every step.
            self.log("train/loss", mean, prog_bar=trainer.progress_bar_callback is not None)
        return loss

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def test_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("test/loss", loss, sync_dist=True)
        return loss

    @override
    def predict_step(self, batch: Batch | torch.Tensor, batch_idx: int) -> torch.Tensor:
        """The logits for a batch's tokens (``tokens`` or ``(tokens, ...)``)."""
        return self(batch[0] if isinstance(batch, (tuple, list)) else batch)

    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        decay, no_decay = [], []
        for param in self.gpt.parameters():
            if param.requires_grad:
                # Matrices (linears, embeddings) decay; vectors (norms, biases) do not.
                (decay if param.dim() >= 2 else no_decay).append(param)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.learning_rate,
            betas=tuple(hp.betas),
            eps=hp.eps,
            fused=_adamw_fused([*decay, *no_decay]),
        )
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup = min(hp.warmup_steps, total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(step, warmup_steps=warmup, total_steps=total, min_ratio=hp.min_lr_ratio),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
