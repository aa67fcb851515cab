"""Build the shipped post-training examples from the shipped corpus: a chat set and a preference set (train and
held-out eval, JSONL) and a small ChatML tokenizer for the tiny models (see data/doc_qa.py, data/chat_tokenizer.py).

Usage:   python MaxLite/make_post_training_data.py [--output_dir assets]     (or: maxlite-make-post-training-data)
Example: python MaxLite/make_post_training_data.py --output_dir data/post_training     (a copy beside the shipped one)

Writes OUTPUT_DIR/post_training/{chats,preferences}-{train,eval}.jsonl, preferences-eval-trained-sections.jsonl and
OUTPUT_DIR/tokenizer/chat/. The files in assets/ are exactly what this writes (a test rebuilds and compares them).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from MaxLite import cli
from MaxLite.data import doc_qa
from MaxLite.data.chat_tokenizer import train_chat_tokenizer

TRAIN = "assets/corpus/train-*.array_record"
EVAL = "assets/corpus/eval-*.array_record"


def run(argv: Sequence[str]) -> None:
  parser = cli.FlagParser(__doc__)
  parser.add_argument("--output_dir", default="assets", help="writes post_training/ and tokenizer/chat/ here")
  args = parser.parse_args(argv)
  sets_dir = os.path.join(args.output_dir, "post_training")
  os.makedirs(sets_dir, exist_ok=True)
  for name, text in doc_qa.build(TRAIN, EVAL).items():
    with open(os.path.join(sets_dir, name), "w", encoding="utf-8") as f:
      f.write(text)
    print(f"{os.path.join(sets_dir, name)}: {text.count(chr(10))} records")
  print(train_chat_tokenizer(TRAIN, os.path.join(args.output_dir, "tokenizer", "chat")))


def main(argv: Sequence[str] | None = None) -> int:
  return cli.run(run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())
