"""Reference models. Users bring their own; nothing in strategies/plugins/callbacks imports this."""

from lightning_scale.models.gpt import GPT, PRESETS, GPTConfig
from lightning_scale.models.module import GPTLightningModule
from lightning_scale.models.parallel import gpt_tensor_parallel_plan

__all__ = ["GPT", "PRESETS", "GPTConfig", "GPTLightningModule", "gpt_tensor_parallel_plan"]
