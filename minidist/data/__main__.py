"""`python -m minidist.data prepare SOURCE --tokenizer T --out DATA_DIR` (minidist.data.prepare) and
`python -m minidist.data verify DATA_DIR` (every file against the manifest's SHA-256, minidist.data.dataset).

Imports stay inside `main`: the prepare workers are spawned processes that import this module by name, and must
not pay for what the parent needs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minidist.data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="tokenize a text source into a dataset directory")
    prep.add_argument("source", help="'stdlib', a text file, a directory of text files, or a glob pattern")
    prep.add_argument("--tokenizer", default="bytes", help="bytes (default), bpe:VOCAB (trained on the source), or "
                                                           "a tokenizer.json / a model directory holding one")
    prep.add_argument("--out", required=True, help="the dataset directory (must be empty, or hold a dataset with "
                                                   "--overwrite)")
    prep.add_argument("--workers", type=int, default=1, help="tokenizing processes (the output is the same)")
    prep.add_argument("--val-fraction", type=float, default=0.05, help="share of the bytes held out, by document")
    prep.add_argument("--max-bytes", type=int, default=None, help="read at most this many bytes of the source")
    prep.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard file (default 2**27)")
    prep.add_argument("--eod-token", default=None, help="the end-of-document token of a loaded tokenizer.json")
    prep.add_argument("--overwrite", action="store_true", help="replace the dataset in --out")
    prep.add_argument("--quiet", action="store_true", help="no progress line")
    ver = sub.add_parser("verify", help="check a dataset's files against its manifest's sizes and SHA-256")
    ver.add_argument("data_dir")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from minidist.data import prepare  # imports no torch: preparing needs none

    try:
        if args.command == "verify":
            from minidist.data import dataset

            ds = dataset.open_dataset(args.data_dir, verify=True)
            print(f"{args.data_dir}: ok, " + ", ".join(f"{k} {v.numel():,} tokens" for k, v in ds.splits.items()))
            return 0
        extra = {} if args.shard_tokens is None else {"shard_tokens": args.shard_tokens}
        m = prepare.prepare(args.source, args.tokenizer, args.out, workers=args.workers, max_bytes=args.max_bytes,
                            val_fraction=args.val_fraction, overwrite=args.overwrite, eod_token=args.eod_token,
                            progress=not args.quiet, **extra)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    splits = ", ".join(f"{k} {v['tokens']:,} tokens in {v['documents']['count']:,} documents"
                       for k, v in m["splits"].items())
    print(f"{args.out}: {m['tokenizer']['spec']} (vocabulary {m['vocab_size']:,}, {m['dtype']}): {splits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
