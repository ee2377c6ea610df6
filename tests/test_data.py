"""Preparing text, reading windows, and the data-parallel sampler."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_scale.cli.prepare import main as prepare_main
from lightning_scale.data import (
    BUNDLED_CORPUS,
    ByteTokenizer,
    DataParallelSampler,
    TextDataModule,
    TokenDataset,
    prepare,
    resolve_dataset,
)


def _read_split(root: Path, split: str) -> np.ndarray:
    meta = json.loads((root / "meta.json").read_text())
    parts = [np.fromfile(root / s["file"], dtype=meta["dtype"]) for s in meta["splits"][split]]
    return np.concatenate(parts) if parts else np.empty(0, dtype=meta["dtype"])


def test_bundled_corpus_is_real_text_of_at_least_a_megabyte() -> None:
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        text = f.read()
    assert len(text) > 1_000_000
    assert "To be, or not to be" in text


def test_prepare_round_trips_text_and_splits_validation_across_the_corpus(tmp_path: Path) -> None:
    text = "".join(f"line {i} of the story\n" for i in range(4000))
    (tmp_path / "a.txt").write_text(text)
    root = prepare(tmp_path / "a.txt", tmp_path / "out", val_fraction=0.1, chunk_tokens=1000)
    train, val = _read_split(root, "train"), _read_split(root, "val")
    assert train.dtype == np.uint16
    assert len(train) + len(val) == len(text.encode())
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.15
    # Every 10th chunk of 1000 tokens went to validation, in order.
    tokens = np.frombuffer(text.encode(), dtype=np.uint8)
    expected_val = np.concatenate([tokens[i * 1000 : (i + 1) * 1000] for i in range(9, len(tokens) // 1000, 10)])
    np.testing.assert_array_equal(val, expected_val)
    assert not list(tmp_path.glob(".out.tmp-*")), "temporary folder left behind"


def test_prepare_reads_jsonl_gz_and_folders_and_separates_documents(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with gzip.open(src / "docs.jsonl.gz", "wt") as f:
        for word in ("alpha", "beta"):
            f.write(json.dumps({"body": word}) + "\n")
    (src / "notes.md").write_text("gamma")
    (src / "ignored.bin").write_bytes(b"\x00")
    root = prepare(src, tmp_path / "out", val_fraction=0.0, text_field="body")
    assert ByteTokenizer().decode(_read_split(root, "train")) == "alpha\n\nbeta\n\ngamma"


def test_prepare_picks_uint32_for_large_vocabularies(tmp_path: Path) -> None:
    class BigVocab:
        name, vocab_size, separator = "big", 100_000, (99_999,)

        def encode(self, text: str) -> list[int]:
            return [70_000 + ord(c) for c in text]

    (tmp_path / "a.txt").write_text("hello")
    root = prepare(tmp_path / "a.txt", tmp_path / "out", tokenizer=BigVocab(), val_fraction=0.0)
    assert json.loads((root / "meta.json").read_text())["dtype"] == "uint32"
    assert _read_split(root, "train").tolist() == [70_000 + ord(c) for c in "hello"]


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        (lambda p: ([p / "missing.txt"], {}), r"Data path '.*missing.txt' does not exist.*bundled Shakespeare corpus"),
        (lambda p: ([p / "empty_dir"], {}), r"holds no text or jsonl files"),
        (lambda p: ([p / "bad.jsonl"], {}), r"bad.jsonl:1 has no string field 'text'; set text_field"),
        (lambda p: ([p / "a.txt"], {"val_fraction": 1.5}), r"val_fraction must lie in \[0, 1\), got 1.5"),
        (lambda p: ([p / "blank.txt"], {}), r"contain no text"),
    ],
)
def test_prepare_rejects_bad_input(tmp_path: Path, setup, match: str) -> None:
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "bad.jsonl").write_text('{"content": "x"}\n')
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "blank.txt").write_text("")
    inputs, kwargs = setup(tmp_path)
    with pytest.raises(ValueError, match=match):
        prepare(inputs, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*")), "a failed prepare left its temporary folder"


def test_an_interrupted_prepare_is_not_mistaken_for_a_prepared_folder(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("abc" * 100)
    partial = tmp_path / ".out.tmp-123"
    partial.mkdir()
    (partial / "train-00000.bin").write_bytes(b"\x01\x00")  # a crash mid-write leaves only this
    root = resolve_dataset(tmp_path / "a.txt", cache_dir=tmp_path / "cache", val_fraction=0.0)
    assert len(_read_split(root, "train")) == 300
    with pytest.raises(ValueError, match="is not a prepared data folder"):
        TokenDataset(partial, "train", 4)


def test_prepare_cli_prints_token_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.txt").write_text("hello world\n" * 100)
    assert prepare_main([str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--val-fraction", "0"]) == 0
    assert "train 1,200 tokens" in capsys.readouterr().out
    assert prepare_main([str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o2")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_token_dataset_windows_are_shifted_pairs(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("".join(chr(97 + i % 26) for i in range(1001)))
    root = prepare(tmp_path / "a.txt", tmp_path / "out", val_fraction=0.0, shard_tokens=400)
    ds = TokenDataset(root, "train", seq_len=10)
    # Shards of 400, 400, 201 tokens -> 39 + 39 + 20 windows, none crossing a shard boundary.
    assert len(ds) == 39 + 39 + 20
    x, y = ds[39]
    assert x.dtype == torch.int64 and x.shape == (10,)
    assert torch.equal(x[1:], y[:-1])
    assert ByteTokenizer().decode(x) == "".join(chr(97 + i % 26) for i in range(400, 410))
    with pytest.raises(IndexError):
        ds[len(ds)]


# ---------------------------------------------------------------- sampler


def _batches(sampler: DataParallelSampler, n: int | None = None) -> list[list[int]]:
    loader = DataLoader(list(range(sampler.num_samples_total)), batch_size=sampler.local_batch_size, sampler=sampler)
    if n is None:
        return [batch.tolist() for batch in loader]
    it = iter(loader)
    return [next(it).tolist() for _ in range(n)]


@pytest.mark.parametrize("dp_size", [1, 2])
def test_resumed_sampler_yields_exactly_the_uninterrupted_batches(dp_size: int) -> None:
    def sampler(rank: int) -> DataParallelSampler:
        return DataParallelSampler(103, global_batch_size=8, dp_rank=rank, dp_size=dp_size, seed=7)

    for rank in range(dp_size):
        full = sampler(rank)
        uninterrupted = []
        for epoch in range(2):
            full.set_epoch(epoch)
            uninterrupted.append(_batches(full))
        assert len(uninterrupted[0]) == 12  # 103 // 8, the partial batch dropped
        assert uninterrupted[0] != uninterrupted[1]  # reshuffled per epoch

        first = sampler(rank)
        first.set_epoch(1)
        seen = _batches(first, n=5)
        state = first.state_dict()
        assert state["epoch"] == 1 and state["consumed_samples"] == 5 * 8

        resumed = sampler(rank)
        resumed.load_state_dict(state)
        resumed.set_epoch(1)  # what Lightning does at the start of the resumed epoch
        assert seen + _batches(resumed) == uninterrupted[1]
        resumed.set_epoch(2)  # the next epoch starts from its beginning again
        assert len(_batches(resumed)) == 12


def test_ranks_together_see_the_single_process_global_batch() -> None:
    single = _batches(DataParallelSampler(64, global_batch_size=8, seed=3))
    ranks = [_batches(DataParallelSampler(64, global_batch_size=8, dp_rank=r, dp_size=4, seed=3)) for r in range(4)]
    for step, batch in enumerate(single):
        assert sum((ranks[r][step] for r in range(4)), []) == batch
        assert all(len(ranks[r][step]) == 2 for r in range(4))


def test_resuming_at_another_data_parallel_size_continues_the_same_global_batches() -> None:
    one = DataParallelSampler(64, global_batch_size=8, seed=3)
    single = _batches(one)
    one_partial = DataParallelSampler(64, global_batch_size=8, seed=3)
    _batches(one_partial, n=3)
    state = one_partial.state_dict()
    rest = []
    for rank in range(2):
        s = DataParallelSampler(64, global_batch_size=8, dp_rank=rank, dp_size=2, seed=3)
        s.load_state_dict(state)
        rest.append(_batches(s))
    assert [a + b for a, b in zip(*rest, strict=True)] == single[3:]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"global_batch_size": 1, "dp_size": 2},
            r"global_batch_size=1 is smaller than the number of data-parallel ranks \(2\).*Use global_batch_size >= 2",
        ),
        (
            {"global_batch_size": 6, "dp_size": 4},
            r"global_batch_size=6 does not split evenly over 4 data-parallel ranks. Use a multiple of 4, e.g. 4 or 8",
        ),
        ({"global_batch_size": 200}, r"The dataset has 100 samples, fewer than one global batch of 200"),
        ({"global_batch_size": 4, "dp_rank": 2, "dp_size": 2}, r"dp_rank=2 must lie in \[0, dp_size=2\)"),
    ],
)
def test_sampler_rejects_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DataParallelSampler(100, **kwargs)


def test_sampler_refuses_a_state_from_other_data() -> None:
    state = DataParallelSampler(100, global_batch_size=4).state_dict()
    with pytest.raises(ValueError, match=r"saved global_batch_size=4 differs from this run's 8"):
        DataParallelSampler(100, global_batch_size=8).load_state_dict(state)


# ---------------------------------------------------------------- data module


def test_datamodule_rejects_a_missing_path_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Data path '.*nowhere' does not exist"):
        TextDataModule(tmp_path / "nowhere")


def test_datamodule_rejects_a_batch_smaller_than_the_data_parallel_size() -> None:
    dm = TextDataModule(global_batch_size=2)
    with pytest.raises(
        ValueError, match=r"global_batch_size=2 is smaller than the number of data-parallel ranks \(4\)"
    ):
        dm.check_data_parallel(4)


def test_datamodule_serves_the_bundled_corpus_without_a_trainer() -> None:
    dm = TextDataModule(seq_len=32, global_batch_size=4)
    dm.prepare_data()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 32) and dm.vocab_size == 256
    assert torch.equal(x[:, 1:], y[:, :-1])
