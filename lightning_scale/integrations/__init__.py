"""Third-party model families the strategies know without a hook. Importing this package registers them."""

from lightning_scale.integrations import huggingface

__all__ = ["huggingface"]
