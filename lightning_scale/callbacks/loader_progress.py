"""Lightning's fit-loop position, re-counted when a checkpoint resumes at another loader batch."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

__all__ = ["LoaderBatchProgress"]

_COUNTS = ("ready", "started", "processed", "completed")


class LoaderBatchProgress(Callback):
    """Re-counts the fit loop's batch progress of a checkpoint saved at another loader batch size.

    Lightning counts the position in an epoch in loader batches (``batch_progress``), and decides where
    a gradient-accumulation window ends from that count. A run resumed at another data-parallel size
    with :class:`~lightning_scale.data.TextDataModule` ``(micro_batch_size=...)`` reads loader batches
    of another size (``dp x micro_batch_size`` samples), so the saved counts are converted to this
    run's loader batches through the samples they stand for, which the
    :class:`~lightning_scale.data.DataParallelSampler` state in the checkpoint records. Then the next
    accumulation window starts where the saved run's next optimizer step started.

    ``ValueError`` when a saved count is not a whole number of this run's loader batches (a
    checkpoint taken inside an accumulation window). The data module adds it to the Trainer (once).
    """

    def __init__(self, loader_batch_size: int) -> None:
        self.loader_batch_size = loader_batch_size

    @classmethod
    def add_to(cls, trainer: Trainer, *, loader_batch_size: int) -> LoaderBatchProgress:
        """The Trainer's one instance, set to ``loader_batch_size`` (samples of one loader batch over all ranks)."""
        found = next((c for c in trainer.callbacks if isinstance(c, cls)), None)
        if found is None:
            found = cls(loader_batch_size)
            trainer.callbacks.append(found)
        found.loader_batch_size = loader_batch_size
        return found

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        fit = checkpoint.get("loops", {}).get("fit_loop")
        if not fit:
            return
        saved = saved_loader_batch_size(fit.get("state_dict", {}).get("combined_loader") or [])
        if saved is None or saved == self.loader_batch_size:
            return
        progress = fit["epoch_loop.batch_progress"]
        for scope in ("total", "current"):
            counts = progress[scope]
            ready, samples = int(counts["ready"]), int(counts["ready"]) * saved
            if samples % self.loader_batch_size:
                raise ValueError(
                    f"The checkpoint's fit loop stands at {ready} loader batches of {saved} samples ({scope}), {samples} "
                    f"samples: not a whole number of this run's loader batches of {self.loader_batch_size} samples (it "
                    "was saved inside a gradient-accumulation window). Resume from a checkpoint saved at an optimizer "
                    "step (ModelCheckpoint), or at a data-parallel size whose loader batch divides it."
                )
            # The other counts trail `ready` by the batch in flight when the checkpoint was saved (one, in
            # on_train_batch_end, which Lightning completes on restart): that batch stays one batch.
            for key in _COUNTS:
                counts[key] = samples // self.loader_batch_size - (ready - int(counts[key]))


def saved_loader_batch_size(loader_states: list[Any]) -> int | None:
    """The loader batch (samples over all ranks) a :class:`DataParallelSampler` state in a checkpoint counted
    in (before positions were in samples: its global batch), or ``None`` when no loader state is one."""
    for state in loader_states:
        if isinstance(state, dict) and "global_batch_size" in state:
            if "loader_batch_size" in state:
                return int(state["loader_batch_size"])
            if "next_batch" in state:
                return int(state["global_batch_size"])
    return None
