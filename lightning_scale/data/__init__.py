"""Datasets: prepared token shards, a data-parallel sampler, and a text data module."""

from lightning_scale.data.datamodule import ResumableDataLoader, TextDataModule, data_parallel_coordinates
from lightning_scale.data.dataset import TokenDataset
from lightning_scale.data.prepare import BUNDLED_CORPUS, ByteTokenizer, Tokenizer, prepare, resolve_dataset
from lightning_scale.data.sampler import DataParallelSampler, check_global_batch

__all__ = [
    "BUNDLED_CORPUS",
    "ByteTokenizer",
    "DataParallelSampler",
    "ResumableDataLoader",
    "TextDataModule",
    "TokenDataset",
    "Tokenizer",
    "check_global_batch",
    "data_parallel_coordinates",
    "prepare",
    "resolve_dataset",
]
