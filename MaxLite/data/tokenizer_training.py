"""Training a sentencepiece tokenizer on ArrayRecord shards, Parquet / JSONL or plain text: train_tokenizer.py's work.

Text is streamed to the trainer one line at a time (sentencepiece's sentence_iterator) and the trainer keeps at most
`input_sentence_size` of them (a uniform sample), so memory is bounded whatever the input size. Ids follow the Llama
convention: unk=0, bos=1, eos=2, no pad piece (padding is segmentation 0 in the batch). byte_fallback makes every
UTF-8 string encodable; normalization is off and whitespace kept as is so that decode(encode(text)) == text, code
indentation included.

Piece scores are rounded to a 1/16 grid after training (on_exact_grid): sentencepiece's Viterbi adds scores in float32
and `tokenizers` (what a Hugging Face export runs) in float64, so where two segmentations tie, as runs of one
character do ("▁▁▁" + "▁▁▁▁▁" or "▁▁▁▁▁" + "▁▁▁"), float32 rounding picks one and float64 the other. On the grid every
path's score is exact in both (up to 2^20, about 100k tokens in one encode) and both break an exact tie alike, towards
the longest last piece: the exported tokenizer.json gives the ids training saw.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import sentencepiece as spm
from array_record.python.array_record_module import ArrayRecordReader
from sentencepiece import sentencepiece_model_pb2

from MaxLite.cli.errors import InputError, first_line
from MaxLite.data.sources import open_source
from MaxLite.storage import expand_globs

# sentencepiece silently drops longer "sentences"; lines above this are cut into pieces.
_MAX_SENTENCE_BYTES = 4096
_RECORDS_PER_READ = 256
# Printable ASCII always gets its own piece, however rare in the corpus (else e.g. '&' or '~' would
# fall back to byte tokens); other rare characters still fall back to bytes.
_REQUIRED_CHARS = "".join(chr(c) for c in range(33, 127))
_SCORE_GRID = 16  # 1/16 nat: far below what separates useful pieces, coarse enough for exact float32 sums


def _documents(path: str, text_column: str) -> Iterator[str]:
  if path.endswith((".parquet", ".jsonl")):  # the documents training reads with grain_file_type=parquet / jsonl
    source = open_source(path, path.rsplit(".", 1)[1], text_column)
    yield from (source[i] for i in range(len(source)))
  elif path.endswith(".array_record"):
    try:
      reader = ArrayRecordReader(path)
      n = reader.num_records()
    except Exception as e:  # the C++ reader raises plain RuntimeError
      raise InputError(f"--input: not a readable ArrayRecord file: {path} ({first_line(e)})") from None
    try:
      for start in range(0, n, _RECORDS_PER_READ):  # bounded batches, never read_all()
        for record in reader.read(list(range(start, min(n, start + _RECORDS_PER_READ)))):
          yield record.decode("utf-8", errors="replace")
    finally:
      reader.close()
  else:
    with open(path, encoding="utf-8", errors="replace") as f:
      while piece := f.readline(1 << 20):
        yield piece


def sentences(files: Sequence[str], text_column: str = "text") -> Iterator[str]:
  """Non-blank lines of every document, each at most _MAX_SENTENCE_BYTES UTF-8 bytes."""
  for path in files:
    for doc in _documents(path, text_column):
      for line in doc.splitlines():
        if not line.strip():
          continue
        data = line.encode("utf-8")
        for i in range(0, len(data), _MAX_SENTENCE_BYTES):
          yield data[i : i + _MAX_SENTENCE_BYTES].decode("utf-8", errors="ignore")


def train_tokenizer(
  input_glob: str,
  model_prefix: str,
  vocab_size: int = 8192,
  *,
  model_type: str = "bpe",
  input_sentence_size: int = 2_000_000,
  character_coverage: float = 0.9995,
  seed: int = 0,
  num_threads: int | None = None,
  text_column: str = "text",
) -> str:
  """Trains and writes `<model_prefix>.model` (and .vocab); returns the .model path."""
  files = expand_globs(input_glob, "--input")
  min_vocab = 256 + 3 + len(_REQUIRED_CHARS) + 1  # byte pieces, unk/bos/eos, required chars, one merge
  if vocab_size < min_vocab:
    raise InputError(f"--vocab_size must be >= {min_vocab} (byte pieces + specials + ASCII), got {vocab_size}")
  os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
  spm.set_random_generator_seed(seed)  # the sentence sample is then reproducible
  spm.SentencePieceTrainer.train(
    sentence_iterator=sentences(files, text_column),
    model_prefix=model_prefix,
    vocab_size=vocab_size,
    model_type=model_type,
    character_coverage=character_coverage,
    required_chars=_REQUIRED_CHARS,
    byte_fallback=True,
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=-1,
    input_sentence_size=input_sentence_size,
    shuffle_input_sentence=True,
    max_sentence_length=_MAX_SENTENCE_BYTES * 4,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    split_digits=True,
    num_threads=num_threads or os.cpu_count() or 1,
    minloglevel=2,
  )
  path = model_prefix + ".model"
  with open(path, "rb") as f:
    proto = on_exact_grid(_parse(f.read()))
  with open(path, "wb") as f:
    f.write(proto.SerializeToString())
  with open(model_prefix + ".vocab", "w", encoding="utf-8") as f:  # sentencepiece's own layout: piece, tab, score
    f.writelines(f"{p.piece}\t{p.score:g}\n" for p in proto.pieces)
  return path


def on_exact_grid(proto: Any) -> Any:
  """The sentencepiece ModelProto with its pieces' scores rounded to multiples of 1/_SCORE_GRID (see the docstring)."""
  for piece in proto.pieces:
    piece.score = round(piece.score * _SCORE_GRID) / _SCORE_GRID
  return proto


def _parse(data: bytes) -> Any:
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(data)
  return proto
