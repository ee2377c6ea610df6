"""Fixed-length windows over memory-mapped token shards."""

from __future__ import annotations

import bisect
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_scale.data.prepare import FORMAT, META_FILE

__all__ = ["TokenDataset"]


class TokenDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item ``i`` is ``(tokens[s:s+L], tokens[s+1:s+L+1])`` with ``s = i * L`` inside one shard.

    Windows do not overlap and never cross a shard boundary. Shards are memory-mapped lazily in
    each process (safe with DataLoader workers), so the dataset costs no memory up front.
    """

    def __init__(self, root: str | os.PathLike[str], split: str, seq_len: int) -> None:
        self.root = Path(root)
        meta_path = self.root / META_FILE
        if not meta_path.is_file():
            raise ValueError(
                f"{str(self.root)!r} is not a prepared data folder (no {META_FILE}); "
                "make one with `lightning-scale-prepare` or pass raw text to TextDataModule."
            )
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{meta_path} has format {meta.get('format')!r}; expected {FORMAT!r}.")
        if split not in meta["splits"]:
            raise ValueError(f"Unknown split {split!r}; {meta_path} has {sorted(meta['splits'])}.")
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.split, self.seq_len = split, seq_len
        self.vocab_size: int = int(meta["vocab_size"])
        self.dtype = np.dtype(meta["dtype"])
        self._files = [self.root / s["file"] for s in meta["splits"][split]]
        self.num_tokens = sum(int(s["tokens"]) for s in meta["splits"][split])
        windows = [max(int(s["tokens"]) - 1, 0) // seq_len for s in meta["splits"][split]]
        self._starts = np.cumsum([0, *windows]).tolist()
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return self._starts[-1]

    def _shard(self, index: int) -> np.memmap:
        if index not in self._maps:
            self._maps[index] = np.memmap(self._files[index], dtype=self.dtype, mode="r")
        return self._maps[index]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        shard = bisect.bisect_right(self._starts, index) - 1
        start = (index - self._starts[shard]) * self.seq_len
        window = torch.from_numpy(self._shard(shard)[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, object]:
        # memmaps are reopened in the receiving process (DataLoader workers with spawn).
        return {**self.__dict__, "_maps": {}}
