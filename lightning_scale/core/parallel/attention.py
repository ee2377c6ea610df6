"""Which fused attention kernels ``F.scaled_dot_product_attention`` can use here, checked at set-up.

On a CUDA device each backend (FlashAttention, cuDNN, memory-efficient) is tried on a small causal
attention in the run's compute dtype under ``torch.nn.attention.sdpa_kernel``, which allows that backend
alone: a backend that cannot run (fp32 for FlashAttention, an old GPU, a build without it) raises, and is
reported as unusable. Neither FlashAttention nor cuDNN usable means attention runs on a slower kernel; the
message says why and what to change. On the CPU, SDPA has its own kernels and there is nothing to check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PRECISION_DTYPES", "describe_sdpa", "sdpa_backends"]

PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16}
"""The compute dtype of Lightning's precision names (float32 for the others)."""


def sdpa_backends(device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> dict[str, bool]:
    """``{"flash": ..., "cudnn": ..., "efficient": ...}``: whether each CUDA backend runs a causal attention of
    ``head_dim`` in ``dtype`` on ``device`` (empty off CUDA)."""
    if device.type != "cuda":
        return {}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    q = torch.randn(1, 2, 128, head_dim, device=device, dtype=dtype)
    usable = {}
    for name, backend in backends.items():
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
            usable[name] = True
        except RuntimeError:
            usable[name] = False
    return usable


def describe_sdpa(device: torch.device, precision: str, head_dim: int = 64) -> str:
    """One line for the set-up log: the kernels attention can use in the run's compute dtype."""
    dtype = PRECISION_DTYPES.get(precision, torch.float32)
    if device.type != "cuda":
        return f"Attention (SDPA) on {device.type}: torch's own kernels for {dtype}; the fused CUDA kernels are checked on a GPU."
    usable = sdpa_backends(device, dtype, head_dim)
    line = f"Attention (SDPA) on {torch.cuda.get_device_name(device)} in {dtype}: " + ", ".join(
        f"{name} {'usable' if ok else 'not usable'}" for name, ok in usable.items()
    )
    if not (usable.get("flash") or usable.get("cudnn")):
        line += (
            ". Neither FlashAttention nor cuDNN attention runs here, so attention takes a slower kernel: train in "
            "bf16-mixed (FlashAttention needs fp16 or bf16) on an Ampere or newer GPU, with a head dimension <= 256."
        )
    return line
