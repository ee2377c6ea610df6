"""``lightning-scale-prepare``: tokenize text/jsonl files into memory-mapped shards."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lightning_scale.data.prepare import META_FILE, prepare

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-scale-prepare",
        description="Tokenize text (.txt, .md) or jsonl files, optionally gzipped, into byte-level token shards "
        "for `lightning-scale-train data.path=OUT`.",
    )
    parser.add_argument("inputs", nargs="+", help="files or folders of them")
    parser.add_argument("--out", required=True, help="folder to create")
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--text-field", default="text", help="jsonl key holding each document (default: text)")
    parser.add_argument("--shard-tokens", type=int, default=1 << 28)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        out = prepare(
            args.inputs,
            args.out,
            val_fraction=args.val_fraction,
            text_field=args.text_field,
            shard_tokens=args.shard_tokens,
            overwrite=args.overwrite,
        )
    except ValueError as err:
        print(f"lightning-scale-prepare: error: {err}", file=sys.stderr)
        return 2
    meta = json.loads((out / META_FILE).read_text())
    counts = {split: sum(s["tokens"] for s in shards) for split, shards in meta["splits"].items()}
    print(f"{out}: " + ", ".join(f"{split} {n:,} tokens" for split, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
