"""Count the collectives and host syncs each training step runs, by where they are called from."""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

from lightning.pytorch import Callback, Trainer
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CountSyncs", "OPTIMIZER"]

SCALAR_READ = "aten._local_scalar_dense"  # .item(), .tolist(), bool()/float()/int() of a tensor
OPTIMIZER = "torch.optim"
"""The call site of reads inside torch's optimizers: their step counters are host tensors on every
device (not a device sync), read by the non-capturable implementations."""


def _call_site() -> str:
    """``file:function`` of the innermost frame outside torch and the package's collective timer
    (paths relative to site-packages or to the package); :data:`OPTIMIZER` inside ``torch.optim``."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename
        if "/torch/optim/" in name:
            return OPTIMIZER
        if "/torch/" in name or name.endswith("syncs.py") or (name.endswith("_telemetry.py") and frame.name == "timed"):
            continue
        return f"{name.split('/site-packages/')[-1].split('/lightning_scale/')[-1]}:{frame.name}"
    return "<c++>"


class _Mode(TorchDispatchMode):
    def __init__(self, counts: Counter[tuple[str, str]]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket._qualified_op_name).replace("::", ".")
        if name.startswith("c10d.") or name == SCALAR_READ:
            self.counts[(name, _call_site())] += 1
        return func(*args, **(kwargs or {}))


class CountSyncs(Callback):
    """``steps[global_step]``: Counter of ``(op, call site)`` from the end of one optimizer step to the
    end of the next (Lightning's per-batch work before ``on_train_batch_start`` counts in the step it
    starts). Ops: every ``c10d`` collective that goes through the dispatcher (those from C++ too, e.g.
    DDP's bucketed all-reduces) and every scalar read of a tensor."""

    def __init__(self) -> None:
        self.steps: dict[int, Counter[tuple[str, str]]] = {}
        self._counts: Counter[tuple[str, str]] = Counter()
        self._mode: _Mode | None = None

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self._mode = _Mode(self._counts)
        self._mode.__enter__()

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Runs last among the callbacks (appended last), before Lightning's own end-of-batch work,
        # which the next step's count then holds.
        self.steps[trainer.global_step] = Counter(self._counts)
        self._counts.clear()

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
