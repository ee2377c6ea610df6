"""Every process's random-number generators as JSON, for its own file in a checkpoint."""

from __future__ import annotations

import base64
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["collect_rng_states", "restore_rng_states"]


def _b64(tensor: Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _from_b64(text: str) -> Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def collect_rng_states() -> dict[str, Any]:
    """This process's random-number generators (python, numpy, torch CPU and every CUDA device), as JSON."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return states


def restore_rng_states(states: Mapping[str, Any]) -> None:
    """Set the generators from :func:`collect_rng_states`'s output (CUDA only where it was saved and exists)."""
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_from_b64(states["torch"]))
    cuda = states.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_from_b64(s) for s in cuda])
