"""Input pipeline throughput on the shipped corpus: one JSON line with tokens/s.

  python end_to_end/bench_input.py [--seq_len 256] [--batch_size 4] [--batches 500] [--worker_count 0]
                                   [--tokenizer_path PATH --tokenizer_type sentencepiece|huggingface|tiktoken]
                                   [--files GLOB --file_type parquet --text_column text]

Times `--batches` batches after `--warmup` batches (the warm-up absorbs file opening and the first
prefetch fill). tokens/s counts every position of a batch (seq_len * batch_size per batch), which
for the packed, forever-repeating pipeline equals real tokens; real_fraction reports the share of
non-padding positions anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from MaxLite.cli.errors import MaxLiteError
from MaxLite.data.grain_pipeline import make_grain_iterator


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--files", default=os.path.join(REPO, "assets", "corpus", "train-*.array_record"))
  p.add_argument("--file_type", default="arrayrecord", help="grain_file_type of --files")
  p.add_argument("--text_column", default="text", help="grain_text_column (parquet / jsonl)")
  p.add_argument("--tokenizer_path", default=os.path.join(REPO, "assets", "tokenizer", "maxlite_sp8k.model"))
  p.add_argument("--tokenizer_type", default="sentencepiece", help="sentencepiece | huggingface | tiktoken")
  p.add_argument("--seq_len", type=int, default=256)
  p.add_argument("--batch_size", type=int, default=4)
  p.add_argument("--warmup", type=int, default=20)
  p.add_argument("--batches", type=int, default=500)
  p.add_argument("--worker_count", type=int, default=0)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  start = time.perf_counter()
  try:
    it = make_grain_iterator(
      args.files,
      tokenizer_path=args.tokenizer_path,
      seq_len=args.seq_len,
      num_slots=args.batch_size,
      slots=tuple(range(args.batch_size)),
      seed=args.seed,
      add_bos=True,
      add_eos=True,
      worker_count=args.worker_count,
      tokenizer_type=args.tokenizer_type,
      file_type=args.file_type,
      text_column=args.text_column,
    )
    next(it)
  except MaxLiteError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  first = time.perf_counter() - start
  for _ in range(args.warmup):
    next(it)
  real = 0
  t0 = time.perf_counter()
  for _ in range(args.batches):
    real += int((next(it)["inputs_segmentation"] > 0).sum())
  seconds = time.perf_counter() - t0
  tokens = args.batches * args.batch_size * args.seq_len
  print(
    json.dumps(
      {
        "bench": "input",
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "batches": args.batches,
        "file_type": args.file_type,
        "worker_count": args.worker_count,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
        "batches_per_s": round(args.batches / seconds, 1),
        "real_fraction": round(real / tokens, 4),
        "first_batch_s": round(first, 3),
      }
    )
  )
  it.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
