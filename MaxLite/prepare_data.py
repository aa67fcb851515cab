"""Turn text or JSONL files into the ArrayRecord shards MaxLite trains on (see data/prepare.py for how).

Example (or: maxlite-prepare-data ...):
  python MaxLite/prepare_data.py --input 'data/*.jsonl' --format jsonl --output_dir out --num_shards 8
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from MaxLite import cli
from MaxLite.cli.errors import InputError
from MaxLite.data.prepare import describe, prepare


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
  p = cli.FlagParser(__doc__)
  p.add_argument("--input", required=True, help="glob(s), comma-separated, of .txt/.jsonl files (.gz ok)")
  p.add_argument("--output_dir", required=True)
  p.add_argument("--num_shards", type=int, default=8, help="train shards")
  p.add_argument("--format", choices=("text", "jsonl"), default="text")
  p.add_argument("--text_field", default="text", help="JSONL: key holding the document text")
  p.add_argument(
    "--on_missing_field",
    choices=("skip", "fail"),
    default="skip",
    help="JSONL line without the text field (or not JSON): count and skip it, or stop",
  )
  p.add_argument("--eval_fraction", type=float, default=0.02, help="share of documents held out for eval")
  p.add_argument(
    "--split_by", choices=("paragraph", "file", "line"), default="paragraph", help="text: what one document is"
  )
  p.add_argument("--min_doc_chars", type=int, default=0, help="paragraph: merge adjacent paragraphs up to this")
  p.add_argument("--max_doc_chars", type=int, default=1_000_000, help="cut longer documents")
  p.add_argument("--overwrite", action="store_true", help="replace shards already in --output_dir")
  return p.parse_args(argv)


def run(argv: Sequence[str]) -> int:
  args = _parse_args(argv)
  options = {k: v for k, v in vars(args).items() if k not in ("input", "output_dir", "num_shards", "format")}
  try:
    summary = prepare(args.input, args.output_dir, args.num_shards, fmt=args.format, progress=sys.stderr, **options)
  except OSError as e:
    raise InputError(str(e)) from None
  print(describe(summary, args.output_dir))
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  return cli.run(run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())
