"""SentencePiece tokenizer wrapper with the small interface the input pipeline needs."""

from __future__ import annotations

from collections.abc import Iterable

import sentencepiece as spm

from MaxLite import paths
from MaxLite.errors import InputError, first_line


class Tokenizer:
  """Text <-> token ids. Picklable (re-loads from its path), so grain worker processes can use it."""

  def __init__(self, path: str):
    self.path = path
    self._sp = _load_processor(path)

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  @property
  def bos_id(self) -> int:
    return self._sp.bos_id()

  @property
  def eos_id(self) -> int:
    return self._sp.eos_id()

  @property
  def pad_id(self) -> int:
    """-1 for our models: padding is expressed by segmentation 0, not by a token."""
    return self._sp.pad_id()

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text, out_type=int)

  def decode(self, ids: Iterable[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def __getstate__(self) -> dict:
    # The C++ processor is not picklable; the serialized model travels instead of the path so a
    # worker on another host does not need the file.
    return {"path": self.path, "proto": self._sp.serialized_model_proto()}

  def __setstate__(self, state: dict) -> None:
    self.path = state["path"]
    self._sp = spm.SentencePieceProcessor()
    self._sp.load_from_serialized_proto(state["proto"])


def _load_processor(path: str) -> spm.SentencePieceProcessor:
  try:
    found = bool(path) and paths.isfile(path)
  except InputError:
    raise
  except Exception as e:  # an unreachable bucket or missing credentials
    raise InputError(f"tokenizer_path: cannot read {path!r} ({type(e).__name__}: {first_line(e)})") from None
  if not found:
    raise InputError(f"tokenizer_path: file not found: {path!r}")
  sp = spm.SentencePieceProcessor()
  try:
    # The model's bytes (local or gs://), so sentencepiece never needs a local copy of the file.
    sp.load_from_serialized_proto(paths.read_bytes(path))
  except (OSError, RuntimeError) as e:
    raise InputError(f"tokenizer_path: not a sentencepiece model: {path!r} ({first_line(e)})") from None
  return sp


def load_tokenizer(path: str) -> Tokenizer:
  """Loads a sentencepiece model; InputError (one line) if it is missing or unreadable."""
  return Tokenizer(path)
