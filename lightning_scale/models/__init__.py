"""Reference models. Users bring their own; nothing in strategies/plugins/callbacks imports this."""

from lightning_scale.models.gpt import GPT, PRESETS, GPTConfig
from lightning_scale.models.module import GPTLightningModule
from lightning_scale.models.parallel import gpt_pipeline_spec, gpt_tensor_parallel_plan, language_model_loss

__all__ = [
    "GPT",
    "PRESETS",
    "GPTConfig",
    "GPTLightningModule",
    "gpt_pipeline_spec",
    "gpt_tensor_parallel_plan",
    "language_model_loss",
]
