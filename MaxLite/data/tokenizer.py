"""Tokenizers behind one small interface (config key `tokenizer_type`): `load_tokenizer(path, tokenizer_type)`.

  sentencepiece   a sentencepiece .model: the shipped one, Llama 2, Mistral (this file)
  huggingface     a tokenizer.json or its directory: Llama 3.x, Qwen, most hub models (hf_tokenizer.py)
  tiktoken        Meta's Llama 3 original/tokenizer.model, a tiktoken BPE file (tiktoken_tokenizer.py)

Every tokenizer gives ids without any special token of its own (the pipeline adds BOS/EOS per add_bos/add_eos),
reports -1 for a special token it does not have, and pickles (grain workers re-create it from the pickle).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import sentencepiece as spm

from MaxLite import storage
from MaxLite.cli.errors import InputError, first_line
from MaxLite.config.choices import TOKENIZER_TYPES


class Tokenizer(Protocol):
  """What the input pipeline and decode.py use. An id of -1 means the tokenizer has no such token."""

  path: str

  @property
  def vocab_size(self) -> int: ...  # one more than the largest id encode or a special token can give

  @property
  def bos_id(self) -> int: ...

  @property
  def eos_id(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Iterable[int]) -> str: ...


class SentencePieceTokenizer:
  """A sentencepiece model. Picklable: the serialized model travels, so a worker needs no copy of the file."""

  def __init__(self, path: str):
    self.path = path
    self._sp = spm.SentencePieceProcessor()
    try:
      # The model's bytes (local or gs://), so sentencepiece never needs a local copy of the file.
      self._sp.load_from_serialized_proto(storage.read_bytes(path))
    except (OSError, RuntimeError) as e:
      raise InputError(
        f"tokenizer_path: not a sentencepiece model: {path!r} ({first_line(e)}); for a tokenizer.json set "
        "tokenizer_type=huggingface, for a tiktoken BPE file tokenizer_type=tiktoken"
      ) from None

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


def _is_directory(path: str) -> bool:
  """Whether `path` is a directory (else a file); InputError if it is neither or cannot be reached."""
  try:
    if path and storage.isfile(path):
      return False
    found = bool(path) and storage.isdir(path)
  except InputError:
    raise
  except Exception as e:  # an unreachable bucket or missing credentials
    raise InputError(f"tokenizer_path: cannot read {path!r} ({type(e).__name__}: {first_line(e)})") from None
  if not found:
    raise InputError(f"tokenizer_path: file not found: {path!r}")
  return True


def load_tokenizer(path: str, tokenizer_type: str = "sentencepiece") -> Tokenizer:
  """The tokenizer at `path` (local or gs://); InputError (one line) if it is missing, unreadable or of
  another type."""
  if tokenizer_type not in TOKENIZER_TYPES:
    raise InputError(f"tokenizer_type={tokenizer_type!r} is not one of: {', '.join(repr(t) for t in TOKENIZER_TYPES)}")
  is_directory = _is_directory(path)
  if tokenizer_type == "huggingface":
    from MaxLite.data.hf_tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(path, is_directory)
  if is_directory:
    raise InputError(
      f"tokenizer_path: {path!r} is a directory; tokenizer_type={tokenizer_type} reads one file "
      "(tokenizer_type=huggingface reads a directory holding tokenizer.json)"
    )
  if tokenizer_type == "tiktoken":
    from MaxLite.data.tiktoken_tokenizer import TiktokenTokenizer

    return TiktokenTokenizer(path)
  return SentencePieceTokenizer(path)


def continuation_text(tokenizer: Tokenizer, prompt: Sequence[int], new: Sequence[int]) -> str:
  """The text `new` adds after `prompt`: decoded together with the prompt, less the prompt's own text. Decoded alone
  a continuation loses what depends on what precedes it (sentencepiece drops its first piece's leading space, a
  byte-level tokenizer may split a character across the boundary)."""
  prompt = [t for t in prompt if t != tokenizer.bos_id]
  before, together = tokenizer.decode(prompt), tokenizer.decode([*prompt, *new])
  return together[len(before) :] if together.startswith(before) else tokenizer.decode(new)
