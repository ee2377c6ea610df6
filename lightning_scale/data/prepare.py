"""Turn text or jsonl files into memory-mapped token shards.

A prepared folder holds ``meta.json`` and raw little-endian token files ``train-00000.bin``,
``val-00000.bin``, ... (uint16 when the vocabulary fits, uint32 otherwise)::

    {"format": "lightning-scale-tokens/1", "tokenizer": "bytes", "vocab_size": 256,
     "dtype": "uint16", "splits": {"train": [{"file": "train-00000.bin", "tokens": 4963012}], ...}}

The folder is written under a temporary sibling name and renamed when complete, so a crash never
leaves a half-written folder that looks prepared. The validation split takes every
``1/val_fraction``-th chunk of ``chunk_tokens`` tokens, so it samples the whole corpus rather
than its last pages.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = [
    "BUNDLED_CORPUS",
    "FORMAT",
    "ByteTokenizer",
    "Tokenizer",
    "default_cache_dir",
    "is_prepared",
    "prepare",
    "resolve_dataset",
]

FORMAT = "lightning-scale-tokens/1"
META_FILE = "meta.json"
TEXT_SUFFIXES = (".txt", ".txt.gz", ".md", ".md.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
_READ_CHARS = 1 << 20


def _bundled_corpus() -> Path:
    return Path(str(resources.files("lightning_scale.data") / "corpus" / "shakespeare.txt.gz"))


BUNDLED_CORPUS: Path = _bundled_corpus()
"""Shakespeare's complete works, public domain (see docs/data.md for the source)."""


class Tokenizer(Protocol):
    """What :func:`prepare` needs of a tokenizer."""

    name: str
    vocab_size: int
    separator: Sequence[int]
    """Token ids written between documents."""

    def encode(self, text: str) -> Sequence[int] | np.ndarray: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256): no files, no download, any language."""

    name: str = "bytes"
    vocab_size: int = 256
    separator: tuple[int, ...] = (10, 10)  # a blank line

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")


def default_cache_dir() -> Path:
    """``$LIGHTNING_SCALE_CACHE`` or ``~/.cache/lightning_scale``."""
    env = os.environ.get("LIGHTNING_SCALE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lightning_scale"


def is_prepared(path: str | os.PathLike[str]) -> bool:
    meta = Path(path) / META_FILE
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")  # noqa: SIM115


def _input_files(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    files: list[Path] = []
    suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(suffixes))
            if not found:
                raise ValueError(
                    f"Data folder {str(path)!r} holds no text or jsonl files (looked for {', '.join(suffixes)})."
                )
            files.extend(found)
        elif path.is_file():
            if not path.name.endswith(suffixes):
                raise ValueError(f"Data file {str(path)!r} has an unknown type; use one of {', '.join(suffixes)}.")
            files.append(path)
        else:
            raise ValueError(
                f"Data path {str(path)!r} does not exist. Pass a text/jsonl file, a folder of them, or a folder "
                "made by `lightning-scale-prepare`; leave the path unset to use the bundled Shakespeare corpus."
            )
    if not files:
        raise ValueError("No data inputs given.")
    return files


def _documents(files: Sequence[Path], text_field: str) -> Iterator[tuple[str, bool]]:
    """Yield ``(text, starts_document)``: each jsonl record and each file starts a document; a long
    text file comes in ~1M-character pieces cut at line ends that continue it."""
    for path in files:
        with _open_text(path) as handle:
            if path.name.endswith(JSONL_SUFFIXES):
                for lineno, line in enumerate(handle, start=1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{lineno} is not valid JSON: {err}") from None
                    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                        raise ValueError(
                            f"{path}:{lineno} has no string field {text_field!r}; set text_field to the key "
                            "that holds each document's text."
                        )
                    yield record[text_field], True
                continue
            starts, carry = True, ""
            while piece := handle.read(_READ_CHARS):
                piece = carry + piece
                cut = piece.rfind("\n") + 1 or len(piece)
                carry = piece[cut:]
                yield piece[:cut], starts
                starts = False
            if carry:
                yield carry, starts


class _ShardWriter:
    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.root, self.split, self.dtype, self.shard_tokens = root, split, dtype, shard_tokens
        self.shards: list[dict[str, object]] = []
        self._handle: io.BufferedWriter | None = None
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        while tokens.size:
            if self._handle is None or self._count >= self.shard_tokens:
                self._roll()
            assert self._handle is not None
            take = min(tokens.size, self.shard_tokens - self._count)
            self._handle.write(tokens[:take].astype(self.dtype, copy=False).tobytes())
            self._count += take
            self.shards[-1]["tokens"] = self._count
            tokens = tokens[take:]

    def _roll(self) -> None:
        self.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._handle = open(self.root / name, "wb")  # noqa: SIM115
        self._count = 0
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def prepare(
    inputs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | None = None,
    val_fraction: float = 0.01,
    chunk_tokens: int = 8192,
    shard_tokens: int = 1 << 28,
    text_field: str = "text",
    overwrite: bool = False,
) -> Path:
    """Tokenize ``inputs`` (files or folders of ``.txt``/``.md``/``.jsonl``, optionally gzipped) into ``out_dir``.

    Returns ``out_dir``. An existing prepared ``out_dir`` is kept unless ``overwrite``.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    tokenizer = tokenizer or ByteTokenizer()
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    if chunk_tokens < 1 or shard_tokens < 1:
        raise ValueError(f"chunk_tokens and shard_tokens must be positive, got {chunk_tokens} and {shard_tokens}")
    files = _input_files(inputs)
    out = Path(out_dir).expanduser().resolve()
    if is_prepared(out) and not overwrite:
        return out
    dtype = np.dtype(np.uint16) if tokenizer.vocab_size <= 1 << 16 else np.dtype(np.uint32)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    writers = {split: _ShardWriter(tmp, split, dtype, shard_tokens) for split in ("train", "val")}
    separator = np.asarray(tokenizer.separator, dtype=np.int64)
    buffer = np.empty(0, dtype=np.int64)
    chunk_index = 0
    held: np.ndarray | None = None  # newest full chunk, held back so the last one can become val
    got_val = False

    def emit(chunk: np.ndarray) -> None:
        nonlocal chunk_index, got_val, held
        if held is not None:
            to_val = int((chunk_index + 1) * val_fraction) > int(chunk_index * val_fraction)
            got_val |= to_val
            writers["val" if to_val else "train"].write(held)
            chunk_index += 1
        held = chunk

    try:
        wrote_any = False
        for text, starts_document in _documents(files, text_field):
            ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
            if ids.size == 0:
                continue
            if ids.min() < 0 or ids.max() >= tokenizer.vocab_size:
                raise ValueError(
                    f"Tokenizer {tokenizer.name!r} produced ids outside [0, {tokenizer.vocab_size}); "
                    "check its vocab_size."
                )
            if starts_document and wrote_any:
                ids = np.concatenate([separator, ids])
            wrote_any = True
            buffer = np.concatenate([buffer, ids])
            while buffer.size >= chunk_tokens:
                emit(buffer[:chunk_tokens])
                buffer = buffer[chunk_tokens:]
        if buffer.size:
            emit(buffer)
        if held is not None:
            # A small corpus may have no chunk picked for validation yet: give it the last one.
            last_to_val = val_fraction > 0 and not got_val and chunk_index > 0
            writers["val" if last_to_val else "train"].write(held)
    except BaseException:
        for writer in writers.values():
            writer.close()
        shutil.rmtree(tmp, ignore_errors=True)  # a failed run leaves nothing behind
        raise
    for writer in writers.values():
        writer.close()

    total = sum(int(s["tokens"]) for w in writers.values() for s in w.shards)
    if total == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"The inputs {[str(f) for f in files]} contain no text.")
    meta = {
        "format": FORMAT,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.name,
        "val_fraction": val_fraction,
        "chunk_tokens": chunk_tokens,
        "sources": [str(f) for f in files],
        "splits": {split: w.shards for split, w in writers.items()},
    }
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
    if overwrite and out.exists():
        shutil.rmtree(out)
    try:
        os.rename(tmp, out)
    except OSError:
        # Another process finished the same folder first; theirs is complete, keep it.
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_prepared(out):
            raise
    return out


def resolve_dataset(
    path: str | os.PathLike[str] | None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    val_fraction: float = 0.01,
    text_field: str = "text",
    tokenizer: Tokenizer | None = None,
) -> Path:
    """A prepared folder for ``path``, preparing raw text into the cache on first use.

    ``None`` means the bundled corpus. A prepared folder is used as it is. Raw files are
    prepared once into ``cache_dir`` under a key of their names, sizes and modification times
    and the preparation options, so every rank resolves the same folder.
    """
    if path is not None and is_prepared(path):
        return Path(path).expanduser().resolve()
    tokenizer = tokenizer or ByteTokenizer()
    files = _input_files([BUNDLED_CORPUS if path is None else path])
    key = hashlib.sha256()
    key.update(f"{FORMAT}|{tokenizer.name}|{tokenizer.vocab_size}|{val_fraction}|{text_field}".encode())
    for f in files:
        stat = f.stat()
        key.update(f"|{f.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    stem = "shakespeare" if path is None else Path(path).name.split(".")[0] or "data"
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / f"{stem}-{tokenizer.name}-{key.hexdigest()[:16]}"
    return prepare(files, target, tokenizer=tokenizer, val_fraction=val_fraction, text_field=text_field)
