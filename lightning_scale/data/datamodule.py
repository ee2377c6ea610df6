"""``TextDataModule``: token windows from text, split over the data-parallel ranks."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_scale.callbacks.loader_progress import LoaderBatchProgress
from lightning_scale.data.dataset import TokenDataset
from lightning_scale.data.prepare import META_FILE, _input_files, is_prepared, resolve_dataset
from lightning_scale.data.sampler import DataParallelSampler, accumulation_steps

__all__ = ["ResumableDataLoader", "TextDataModule", "data_parallel_coordinates"]


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`DataParallelSampler` whose position Lightning saves.

    Lightning stores the ``state_dict`` of every training loader that has one in its checkpoints
    and hands it back on resume, so a run restarted mid-epoch continues on exactly the next batch.

    Args:
        consumed_batches: returns how many batches of the current epoch were actually trained
            on. DataLoader workers fetch ahead (``prefetch_factor`` batches each), so the
            sampler's own count runs ahead of the truth; ``TextDataModule`` passes the fit loop's.
    """

    def __init__(
        self, dataset: Any, *, consumed_batches: Callable[[], int | None] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(dataset, **kwargs)
        if not isinstance(self.sampler, DataParallelSampler):
            raise TypeError(f"ResumableDataLoader needs a DataParallelSampler, got {type(self.sampler).__name__}")
        self.consumed_batches = consumed_batches

    def state_dict(self) -> dict[str, Any]:
        consumed = self.consumed_batches() if self.consumed_batches is not None else None
        return self.sampler.state_dict(consumed_batches=consumed)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state_dict)


def data_parallel_coordinates(strategy: Any) -> tuple[int, int]:
    """``(dp_rank, dp_size)`` of a Lightning strategy.

    Read from ``distributed_sampler_kwargs``, which Lightning's parallel strategies (and
    ``HybridParallelStrategy``, over its ``dp`` mesh dimension) define; single-device strategies
    have none and are one data-parallel rank.
    """
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))


class TextDataModule(LightningDataModule):
    """Next-token windows of ``seq_len`` tokens from text, in global batches.

    Args:
        path: a prepared folder (``lightning-scale-prepare``), or text/jsonl files or a folder of
            them (prepared into ``cache_dir`` on first use). ``None``: the bundled Shakespeare corpus.
        seq_len: tokens per training sequence; at most the model's ``block_size``.
        global_batch_size: sequences per optimizer step over all data-parallel ranks together. The
            same value gives the same data at every layout. Without ``micro_batch_size``: each rank
            loads ``global_batch_size / dp_size`` per batch (and ``Trainer(accumulate_grad_batches=k)``
            makes an optimizer step of ``k`` such global batches).
        micro_batch_size: sequences per rank and loader batch. Then gradient accumulation is derived
            at every ``setup`` from the data-parallel size of that run: ``accumulate_grad_batches =
            global_batch_size / (dp_size x micro_batch_size)``, set on the Trainer, so the global
            batch, the sample order and the optimizer's gradient stay those of any other layout (an
            elastic restart at a smaller world accumulates more). ``ValueError`` when it does not
            divide, or when the Trainer was given another ``accumulate_grad_batches``.
        val_fraction: share of the text held out for validation when preparing raw text.
        shuffle: reshuffle training windows every epoch (validation is never shuffled).
        seed: shuffling seed; the order depends on ``seed + epoch`` only.
        num_workers: DataLoader workers per rank.
        text_field: the key holding each document in jsonl input.
        cache_dir: where raw text is prepared; default ``$LIGHTNING_SCALE_CACHE`` or ``~/.cache/lightning_scale``.

    The training loader is a :class:`ResumableDataLoader`: a run resumed from a mid-epoch
    checkpoint continues on exactly the next batch.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        seq_len: int = 128,
        global_batch_size: int = 16,
        micro_batch_size: int | None = None,
        val_fraction: float = 0.01,
        shuffle: bool = True,
        seed: int = 1234,
        num_workers: int = 0,
        text_field: str = "text",
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        accumulation_steps(global_batch_size, 1, micro_batch_size)  # ValueError for a bad size, before any work
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if path is not None and not is_prepared(path):
            _input_files([path])  # raises a ValueError naming a missing path now, before any process starts
        self.path = None if path is None else str(path)
        self.seq_len, self.global_batch_size, self.micro_batch_size = seq_len, global_batch_size, micro_batch_size
        self.val_fraction, self.shuffle, self.seed = val_fraction, shuffle, seed
        self.num_workers, self.text_field = num_workers, text_field
        self.cache_dir = cache_dir
        self._root: Path | None = None
        self._datasets: dict[str, TokenDataset] = {}
        self._dp = (0, 1)
        self._accumulation: int | None = None  # what setup set on the Trainer (micro_batch_size)

    def check_data_parallel(self, dp_size: int) -> int:
        """The gradient accumulation ``dp_size`` ranks need for one global batch (1 without ``micro_batch_size``);
        ``ValueError`` if the global batch cannot be split over them."""
        return accumulation_steps(self.global_batch_size, dp_size, self.micro_batch_size)

    def _set_accumulation(self, trainer: Any, accumulation: int) -> None:
        """``micro_batch_size``: the Trainer accumulates ``accumulation`` loader batches per optimizer step."""
        given = trainer.accumulate_grad_batches
        if given not in (1, accumulation, self._accumulation):
            raise ValueError(
                f"Trainer(accumulate_grad_batches={given}) disagrees with TextDataModule(micro_batch_size="
                f"{self.micro_batch_size}): global_batch_size={self.global_batch_size} over {self._dp[1]} data-parallel "
                f"ranks needs {accumulation} micro-batches per optimizer step, which the data module sets itself. "
                "Leave accumulate_grad_batches at 1 (or remove micro_batch_size to accumulate by hand)."
            )
        if any(type(cb).__name__ == "GradientAccumulationScheduler" for cb in trainer.callbacks):
            raise ValueError(
                "A GradientAccumulationScheduler would change the accumulation TextDataModule(micro_batch_size="
                f"{self.micro_batch_size}) derives from the global batch. Remove one of them."
            )
        self._accumulation = trainer.accumulate_grad_batches = accumulation

    def _resolve(self) -> Path:
        return resolve_dataset(
            self.path, cache_dir=self.cache_dir, val_fraction=self.val_fraction, text_field=self.text_field
        )

    @override
    def prepare_data(self) -> None:
        self._resolve()

    @override
    def setup(self, stage: str) -> None:
        if self.trainer is not None:
            self._dp = data_parallel_coordinates(self.trainer.strategy)
        accumulation = self.check_data_parallel(self._dp[1])
        if self.trainer is not None:
            if self.micro_batch_size is not None:
                self._set_accumulation(self.trainer, accumulation)
            # A checkpoint saved at another loader batch (another dp size) resumes at the same sample.
            LoaderBatchProgress.add_to(self.trainer, loader_batch_size=self.global_batch_size // accumulation)
        self._root = self._resolve()
        splits = {"fit": ("train", "val"), "validate": ("val",), "test": ("val",)}.get(stage, ("val",))
        for split in splits:
            if split not in self._datasets:
                dataset = TokenDataset(self._root, split, self.seq_len)
                if len(dataset) < self.global_batch_size:
                    raise ValueError(
                        f"The {split!r} split of {self._root} has {len(dataset)} windows of {self.seq_len + 1} "
                        f"tokens, fewer than one global batch of {self.global_batch_size}. Lower "
                        "global_batch_size or seq_len, or use more data (or a larger val_fraction)."
                    )
                self._datasets[split] = dataset

    @property
    def vocab_size(self) -> int:
        """Vocabulary of the prepared data (prepares raw text first if needed)."""
        if self._root is None:
            self._root = self._resolve()
        return int(json.loads((self._root / META_FILE).read_text())["vocab_size"])

    def _loader(
        self, split: str, shuffle: bool, loader_cls: type[DataLoader] = DataLoader, **kwargs: Any
    ) -> DataLoader:
        dataset = self._datasets[split]
        dp_rank, dp_size = self._dp
        sampler = DataParallelSampler(
            dataset,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            shuffle=shuffle,
            seed=self.seed,
        )
        return loader_cls(
            dataset,
            batch_size=sampler.local_batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            **kwargs,
        )

    def _consumed_train_batches(self) -> int | None:
        if self.trainer is None:
            return None
        # Batches the fit loop has taken this epoch; batches prefetched by workers are not among them.
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.ready

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.shuffle, ResumableDataLoader, consumed_batches=self._consumed_train_batches)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("val", False)
