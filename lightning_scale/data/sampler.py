"""A sampler that splits every global batch over the data-parallel ranks, and can resume."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DistributedSampler

__all__ = ["DataParallelSampler", "check_global_batch"]


class DataParallelSampler(DistributedSampler):
    """Sample indices for one data-parallel rank, one global batch at a time.

    The dataset is permuted once per epoch (seeded by ``seed + epoch``) and cut into global
    batches of ``global_batch_size`` samples (a trailing partial batch is dropped). Rank ``r`` of
    ``dp_size`` takes the ``r``-th contiguous slice of ``global_batch_size / dp_size`` samples of
    each global batch; use it with ``DataLoader(batch_size=sampler.local_batch_size)``.

    So the union of all ranks' batches is the same global batch at every data-parallel size: a
    run at dp=2 sees exactly the data of a run at dp=1, and a checkpoint resumes at another size.

    ``dp_rank``/``dp_size`` are the **data-parallel** coordinates, not the global ones: with tensor
    or pipeline parallelism every rank of one model replica must read the same batch.

    ``state_dict()`` records the epoch and how many batches this sampler has handed out;
    ``load_state_dict()`` makes the next iteration of that epoch start at the following batch.
    A consumer that fetches ahead (workers, Lightning's prefetch) should record what it consumed
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
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        # DistributedSampler.__init__ would query the default process group; nothing here needs it.
        num_samples = dataset if isinstance(dataset, int) else len(dataset)
        if not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size must be a positive integer, got {dp_size!r}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        check_global_batch(global_batch_size, dp_size)
        if num_samples < global_batch_size:
            raise ValueError(
                f"The dataset has {num_samples} samples, fewer than one global batch of {global_batch_size}. "
                "Lower the batch size or the sequence length, or use more data."
            )
        self.num_samples_total = num_samples
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.shuffle, self.seed = shuffle, seed
        self.num_batches = num_samples // global_batch_size
        self.epoch = 0
        self._handed_out = 0
        self._resume: tuple[int, int] | None = None
        # DistributedSampler's public attributes, for code that reads them.
        self.num_replicas, self.rank, self.drop_last = dp_size, dp_rank, True
        self.num_samples = self.num_batches * self.local_batch_size
        self.total_size = self.num_batches * global_batch_size

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
            offset = batch * self.global_batch_size + self.dp_rank * self.local_batch_size
            yield from order[offset : offset + self.local_batch_size].tolist()

    def state_dict(self, consumed_batches: int | None = None) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "next_batch": self._handed_out if consumed_batches is None else consumed_batches,
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
                    "Resume with the same data, seed and global batch size (the data-parallel size may change)."
                )
        self.epoch = int(state["epoch"])
        self._resume = (self.epoch, int(state["next_batch"]))


def check_global_batch(global_batch_size: int, dp_size: int) -> None:
    """Raise ``ValueError`` unless ``global_batch_size`` splits evenly over ``dp_size`` ranks."""
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
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
