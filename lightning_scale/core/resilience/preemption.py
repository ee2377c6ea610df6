"""Preemption: the signals that mean "stop soon", the flag their handler sets, and the one agreement per
optimizer step on whether any rank got one.

The handler only sets a flag: a collective inside a signal handler can pair with the wrong call on another
rank (which Lightning's own SIGTERM handler risks). At a step boundary every rank all-reduces its flag
(:func:`anyone_signalled`), so all of them stop at the same step even when only one was signalled; what
stopping means (a checkpoint, then :class:`Preempted`) is the caller's. Two callers:
``HybridParallelStrategy``'s own (:mod:`lightning_scale.strategies.hybrid.resilience`) and the
:class:`~lightning_scale.callbacks.PreemptionCheckpoint` callback for other strategies.
"""

from __future__ import annotations

import signal
import warnings
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SIGNALS", "Preempted", "SignalFlag", "anyone_signalled", "check_exit_code", "check_signals"]

SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGUSR1": signal.SIGUSR1, "SIGUSR2": signal.SIGUSR2, "SIGINT": signal.SIGINT}
"""The signals a run may treat as "stop soon", by name."""


class Preempted(SystemExit):
    """Raised on every rank after the checkpoint that stops the run is committed (a preemption signal; a
    subclass for another reason, e.g. ``StragglerRestart``); the process exits with ``code``."""


def check_signals(signals: Sequence[str]) -> tuple[str, ...]:
    """``signals`` as a tuple; ``ValueError`` naming the unknown ones and the allowed names."""
    unknown = [s for s in signals if s not in SIGNALS]
    if unknown or not signals:
        raise ValueError(f"signals={signals!r}: each must be one of {sorted(SIGNALS)} (at least one).")
    return tuple(signals)


def check_exit_code(exit_code: Any) -> int:
    """``exit_code`` if it is an integer from 1 to 255, else ``ValueError`` (0 would end a torchrun job)."""
    if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 1 <= exit_code <= 255:
        raise ValueError(f"exit_code={exit_code!r} must be an integer from 1 to 255 (0 would end a torchrun job).")
    return exit_code


class SignalFlag:
    """The handlers of ``signals`` for as long as it is installed: each sets :attr:`received`, nothing else.

    Args:
        signals: names among :data:`SIGNALS`.
        owner: the name warnings give (the class that installs it).
    """

    def __init__(self, signals: Sequence[str], *, owner: str) -> None:
        self.signals = check_signals(signals)
        self.owner = owner
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def installed(self) -> dict[int, Any]:
        """The signals handled now, each with the handler it replaced."""
        return dict(self._previous)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum  # nothing else here: the step boundary acts on it

    def install(self) -> None:
        """Handle the signals from now on (a second call does nothing); the flag starts clear."""
        if self._previous:
            return
        self.received = None
        for name in self.signals:
            sig = SIGNALS[name]
            if signal.getsignal(sig) is None:
                # Installed outside Python (faulthandler.register, a native library): Python can neither
                # chain to it nor put it back.
                warnings.warn(
                    f"{self.owner}: {name} has a handler installed outside Python (e.g. faulthandler.register); it "
                    f"is replaced during fit and {name} has its default action afterwards. Leave {name} out of the "
                    "signals handled to keep it.",
                    stacklevel=2,
                )
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: signals cannot be handled here
                warnings.warn(f"{self.owner}: cannot handle {name} outside the main thread.", stacklevel=2)

    def restore(self) -> None:
        """The handlers from before :meth:`install` again."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}


def anyone_signalled(received: bool, device: torch.device) -> bool:
    """Whether any rank of the default process group was signalled: one all-reduce of a flag (and its host
    read), the same answer on every rank. Every rank must call it at the same point."""
    flag = torch.tensor([1 if received else 0], device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
