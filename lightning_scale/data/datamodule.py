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

from lightning_scale.data.dataset import TokenDataset
from lightning_scale.data.prepare import META_FILE, _input_files, is_prepared, resolve_dataset
from lightning_scale.data.sampler import DataParallelSampler, check_global_batch

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
        global_batch_size: sequences per optimizer micro-step over all data-parallel ranks
            together; each rank loads ``global_batch_size / dp_size``. The same value gives the same
            data at every layout.
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
        check_global_batch(global_batch_size, 1)
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if path is not None and not is_prepared(path):
            _input_files([path])  # raises a ValueError naming a missing path now, before any process starts
        self.path = None if path is None else str(path)
        self.seq_len, self.global_batch_size = seq_len, global_batch_size
        self.val_fraction, self.shuffle, self.seed = val_fraction, shuffle, seed
        self.num_workers, self.text_field = num_workers, text_field
        self.cache_dir = cache_dir
        self._root: Path | None = None
        self._datasets: dict[str, TokenDataset] = {}
        self._dp = (0, 1)

    def check_data_parallel(self, dp_size: int) -> None:
        """Raise ``ValueError`` if the global batch cannot be split over ``dp_size`` ranks."""
        check_global_batch(self.global_batch_size, dp_size)

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
        self.check_data_parallel(self._dp[1])
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

    def _loader(self, split: str, shuffle: bool, loader_cls: type[DataLoader] = DataLoader, **kwargs: Any) -> DataLoader:
        dataset = self._datasets[split]
        dp_rank, dp_size = self._dp
        sampler = DataParallelSampler(
            dataset,
            global_batch_size=self.global_batch_size,
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
        return self._loader(
            "train", self.shuffle, ResumableDataLoader, consumed_batches=self._consumed_train_batches
        )

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("val", False)
