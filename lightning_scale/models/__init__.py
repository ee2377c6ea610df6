"""Reference models. Users bring their own; nothing in strategies/plugins/callbacks imports this."""

from typing import TYPE_CHECKING, Any

from lightning_scale.models.gpt import GPT, PRESETS, GPTConfig
from lightning_scale.models.parallel import gpt_pipeline_spec, gpt_tensor_parallel_plan, language_model_loss

if TYPE_CHECKING:
    from lightning_scale.models.module import GPTLightningModule

__all__ = [
    "GPT",
    "PRESETS",
    "GPTConfig",
    "GPTLightningModule",
    "gpt_pipeline_spec",
    "gpt_tensor_parallel_plan",
    "language_model_loss",
]


def __getattr__(name: str) -> Any:
    # The LightningModule imports Lightning (seconds): only when asked for, so the planner's sizing and
    # model configs (GPTConfig, PRESETS) come without it.
    if name == "GPTLightningModule":
        from lightning_scale.models.module import GPTLightningModule

        return GPTLightningModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
