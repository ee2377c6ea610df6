"""A sampler that splits every global batch over the data-parallel ranks, and can resume."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DistributedSampler

__all__ = ["DataParallelSampler", "accumulation_steps", "check_global_batch"]


class DataParallelSampler(DistributedSampler):
    """Sample indices for one data-parallel rank, one global batch at a time.

    The dataset is permuted once per epoch (seeded by ``seed + epoch``) and cut into global
    batches of ``global_batch_size`` samples (a trailing partial batch is dropped). A global batch
    is read as ``accumulation`` loader batches of ``dp_size x local_batch_size`` samples each, in
    order; rank ``r`` of ``dp_size`` takes the ``r``-th contiguous slice of ``local_batch_size``
    samples of each loader batch. Use it with ``DataLoader(batch_size=sampler.local_batch_size)``.

    - ``micro_batch_size=None``: one loader batch per global batch, ``global_batch_size / dp_size``
      samples per rank (``accumulation == 1``).
    - ``micro_batch_size=m``: ``m`` samples per rank and loader batch, so one global batch is
      ``accumulation = global_batch_size / (dp_size x m)`` loader batches: an optimizer step with
      ``Trainer(accumulate_grad_batches=sampler.accumulation)`` sees exactly one global batch.

    So the union of the loader batches of one global batch is the same at every data-parallel size:
    a run at dp=2 with accumulation 2 sees exactly the data of a run at dp=4 without.

    ``dp_rank``/``dp_size`` are the **data-parallel** coordinates, not the global ones: with tensor
    or pipeline parallelism every rank of one model replica must read the same batch.

    ``state_dict()`` records the epoch and the position in **samples** consumed this epoch (and the
    loader batch it was counted in); ``load_state_dict()`` makes the next iteration of that epoch
    start there, at this sampler's loader batch, which may differ from the saver's as long as the
    position is a whole number of this sampler's loader batches (``ValueError`` otherwise). A
    consumer that fetches ahead (workers, Lightning's prefetch) should record what it consumed
    instead: ``state_dict(consumed_batches=n)``.

    It subclasses ``DistributedSampler`` only so that Lightning sees the data as already split
    and does not inject a sampler of its own over the global world.
    """

    def __init__(
        self,
        dataset: Sized | int,
        *,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        micro_batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        # DistributedSampler.__init__ would query the default process group; nothing here needs it.
        num_samples = dataset if isinstance(dataset, int) else len(dataset)
        if not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size must be a positive integer, got {dp_size!r}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        self.accumulation = accumulation_steps(global_batch_size, dp_size, micro_batch_size)
        if num_samples < global_batch_size:
            raise ValueError(
                f"The dataset has {num_samples} samples, fewer than one global batch of {global_batch_size}. "
                "Lower the batch size or the sequence length, or use more data."
            )
        self.num_samples_total = num_samples
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // (dp_size * self.accumulation)
        self.loader_batch_size = self.local_batch_size * dp_size
        """Samples of one loader batch over all data-parallel ranks (``global_batch_size / accumulation``)."""
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.shuffle, self.seed = shuffle, seed
        self.num_batches = (num_samples // global_batch_size) * self.accumulation
        self.epoch = 0
        self._handed_out = 0
        self._resume: tuple[int, int] | None = None
        # DistributedSampler's public attributes, for code that reads them.
        self.num_replicas, self.rank, self.drop_last = dp_size, dp_rank, True
        self.num_samples = self.num_batches * self.local_batch_size
        self.total_size = self.num_batches * self.loader_batch_size

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        start = 0
        if self._resume is not None:
            resume_epoch, resume_batch = self._resume
            self._resume = None
            if resume_epoch == self.epoch:
                start = resume_batch
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples_total, generator=generator)
        else:
            order = torch.arange(self.num_samples_total)
        self._handed_out = start
        for batch in range(start, self.num_batches):
            self._handed_out = batch + 1
            offset = batch * self.loader_batch_size + self.dp_rank * self.local_batch_size
            yield from order[offset : offset + self.local_batch_size].tolist()

    def state_dict(self, consumed_batches: int | None = None) -> dict[str, Any]:
        batches = self._handed_out if consumed_batches is None else consumed_batches
        return {
            "epoch": self.epoch,
            "consumed_samples": batches * self.loader_batch_size,
            "loader_batch_size": self.loader_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch_size": self.global_batch_size,
            "num_samples": self.num_samples_total,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "shuffle", "global_batch_size", "num_samples"):
            ours = getattr(self, "num_samples_total" if key == "num_samples" else key)
            if state[key] != ours:
                raise ValueError(
                    f"Cannot resume the sampler: the saved {key}={state[key]!r} differs from this run's {ours!r}. "
                    "Resume with the same data, seed and global batch size (the data-parallel size and the "
                    "micro-batch size may change)."
                )
        # A state from before positions were counted in samples: its loader batch was the global batch.
        consumed = state.get("consumed_samples", int(state.get("next_batch", 0)) * self.global_batch_size)
        if consumed % self.loader_batch_size:
            raise ValueError(
                f"Cannot resume the sampler at {consumed} consumed samples of epoch {state['epoch']}: that is not a "
                f"whole number of this run's loader batches of {self.loader_batch_size} samples ({self.dp_size} "
                f"data-parallel ranks x {self.local_batch_size}); the checkpoint was saved in the middle of a "
                f"gradient-accumulation window. Resume from a checkpoint saved at an optimizer step, or with a "
                f"data-parallel size and micro-batch size whose loader batch divides {consumed}."
            )
        self.epoch = int(state["epoch"])
        self._resume = (self.epoch, consumed // self.loader_batch_size)


def check_global_batch(global_batch_size: int, dp_size: int) -> None:
    """Raise ``ValueError`` unless ``global_batch_size`` splits evenly over ``dp_size`` ranks."""
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    if global_batch_size < dp_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} is smaller than the number of data-parallel ranks "
            f"({dp_size}): every rank needs at least one sample. Use global_batch_size >= {dp_size} "
            f"(a multiple of {dp_size}) or fewer data-parallel ranks."
        )
    if global_batch_size % dp_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} does not split evenly over {dp_size} data-parallel ranks. "
            f"Use a multiple of {dp_size}, e.g. {(global_batch_size // dp_size) * dp_size or dp_size} or "
            f"{(global_batch_size // dp_size + 1) * dp_size}."
        )


def accumulation_steps(global_batch_size: int, dp_size: int, micro_batch_size: int | None) -> int:
    """Loader batches per global batch: ``global_batch_size / (dp_size x micro_batch_size)`` (1 without a
    micro-batch size); ``ValueError`` naming the sizes and the fix when it is not a whole number."""
    check_global_batch(global_batch_size, dp_size)
    if micro_batch_size is None:
        return 1
    if not isinstance(micro_batch_size, int) or isinstance(micro_batch_size, bool) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive integer or None, got {micro_batch_size!r}")
    per_rank = global_batch_size // dp_size
    if per_rank % micro_batch_size:
        fits = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        raise ValueError(
            f"global_batch_size={global_batch_size} over {dp_size} data-parallel ranks is {per_rank} samples per rank "
            f"and optimizer step, not a whole number of micro-batches of micro_batch_size={micro_batch_size}, so "
            f"gradient accumulation has no whole number of steps. Use a micro_batch_size among {fits}, or a "
            f"global_batch_size that is a multiple of {dp_size * micro_batch_size} (data-parallel ranks x micro_batch_size)."
        )
    return per_rank // micro_batch_size
