r"""Train a sentencepiece tokenizer on the shards prepare_data.py writes, Parquet / JSONL files or plain text (see
data/tokenizer_training.py for how).

Example (or: maxlite-train-tokenizer ...):
  python MaxLite/train_tokenizer.py --input 'assets/corpus/train-*.array_record' \
      --model_prefix data/mine/sp --vocab_size 8192

writes data/mine/sp.model and sp.vocab; the shipped assets/tokenizer/maxlite_sp8k.model is this command's output.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import sentencepiece as spm

from MaxLite import cli
from MaxLite.cli.errors import InputError
from MaxLite.data.tokenizer_training import train_tokenizer


def run(argv: Sequence[str]) -> int:
  p = cli.FlagParser(__doc__)
  p.add_argument("--input", required=True, help="glob(s), comma-separated: .array_record, .parquet, .jsonl or text")
  p.add_argument("--text_column", default="text", help="the text of .parquet rows / .jsonl objects (grain_text_column)")
  p.add_argument("--model_prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
  p.add_argument("--vocab_size", type=int, default=8192)
  p.add_argument("--model_type", choices=("bpe", "unigram"), default="bpe")
  p.add_argument("--input_sentence_size", type=int, default=2_000_000, help="max lines sampled for training")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--overwrite", action="store_true", help="replace PREFIX.model and PREFIX.vocab if they exist")
  args = p.parse_args(argv)
  existing = [
    f"{args.model_prefix}.{ext}" for ext in ("model", "vocab") if os.path.exists(f"{args.model_prefix}.{ext}")
  ]
  if existing and not args.overwrite:  # a run's tokenizer, replaced, would silently re-map every token it trained on
    raise InputError(f"{', '.join(existing)} already exist(s); pass --overwrite to replace, or another --model_prefix")
  try:
    path = train_tokenizer(
      args.input,
      args.model_prefix,
      args.vocab_size,
      model_type=args.model_type,
      input_sentence_size=args.input_sentence_size,
      seed=args.seed,
      text_column=args.text_column,
    )
  except RuntimeError as e:  # sentencepiece's own complaints, e.g. a vocabulary too large for the text
    raise InputError(f"sentencepiece: {str(e).strip().splitlines()[-1]}") from None
  sp = spm.SentencePieceProcessor(model_file=path)
  print(
    f"train_tokenizer: wrote {path} (vocab {sp.get_piece_size()}, unk={sp.unk_id()} bos={sp.bos_id()} "
    f"eos={sp.eos_id()})"
  )
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  return cli.run(run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())
