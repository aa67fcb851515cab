"""tokenizer_type=huggingface: a `tokenizer.json` (Llama 3.x, Qwen, Mistral, most hub models) via the `tokenizers`
library, the same library transformers' fast tokenizers run on.

tokenizer_path is the tokenizer.json file or the directory holding it. BOS/EOS/pad come from the
tokenizer_config.json (else special_tokens_map.json) beside it, as transformers reads them; a key the files do not
set falls back to a well-known special token in the vocabulary; an explicit null (Qwen's bos_token) means none (-1).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tokenizers import Tokenizer

from MaxLite import storage
from MaxLite.cli.errors import InputError, first_line

_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# Spellings of BOS/EOS/pad in common model families, most specific first (<|endoftext|> ends a document in Qwen
# and GPT-2; <|im_end|> only a chat turn, so it comes last).
_WELL_KNOWN = {
  "bos": ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>"),
  "eos": ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>", "<|im_end|>"),
  "pad": ("<pad>", "<|pad|>", "<|finetune_right_pad_id|>"),
}


def read_json_object(path: str) -> dict[str, Any] | None:
  """The JSON object in a tokenizer's file `path`, None when there is no such file; InputError if it holds another."""
  if not storage.isfile(path):
    return None
  try:
    data = json.loads(storage.read_text(path))
  except (OSError, ValueError) as e:
    raise InputError(f"tokenizer_path: cannot read {path!r} ({first_line(e)})") from None
  if not isinstance(data, dict):
    raise InputError(f"tokenizer_path: {path!r} does not hold a JSON object")
  return data


class HuggingFaceTokenizer:
  """A `tokenizers.Tokenizer` from tokenizer.json, with the special-token ids resolved once. Picklable (the
  tokenizers object pickles as its JSON)."""

  def __init__(self, path: str, is_directory: bool):
    self.path = path
    folder = path if is_directory else storage.dirname(path)
    file = storage.join(path, "tokenizer.json") if is_directory else path
    if is_directory and not storage.isfile(file):
      raise InputError(
        f"tokenizer_path: no tokenizer.json in {path!r}; tokenizer_type=huggingface needs a tokenizer.json "
        "file or a directory holding one"
      )
    try:
      self._tok = Tokenizer.from_str(storage.read_text(file))
    except Exception as e:  # the Rust parser raises a plain Exception
      raise InputError(f"tokenizer_path: not a Hugging Face tokenizer.json: {file!r} ({first_line(e)})") from None
    # Some tokenizer.json files ship with truncation or padding on; a pretraining document must stay whole
    # (transformers turns them off per call too).
    self._tok.no_truncation()
    self._tok.no_padding()
    configs = [(name, read_json_object(storage.join(folder, name))) for name in _CONFIG_FILES]
    self.bos_id, self.eos_id, self.pad_id = (self._special_id(kind, configs) for kind in ("bos", "eos", "pad"))
    vocab = self._tok.get_vocab(with_added_tokens=True)
    # Added tokens may leave gaps, so the largest id (not the count) decides how many embedding rows are needed.
    self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)

  def _special_id(self, kind: str, configs: list[tuple[str, dict[str, Any] | None]]) -> int:
    key = f"{kind}_token"
    for name, config in configs:
      if config is None or key not in config:
        continue
      token = config[key]
      if isinstance(token, dict):  # an AddedToken written out: {"content": "<s>", "lstrip": false, ...}
        token = token.get("content")
      if token is None:
        return -1
      token_id = self._tok.token_to_id(str(token))
      if token_id is None:
        raise InputError(f"tokenizer_path: {key} {token!r} of {name} is not in the vocabulary of {self.path!r}")
      return token_id
    for token in _WELL_KNOWN[kind]:
      token_id = self._tok.token_to_id(token)
      if token_id is not None:
        return token_id
    return -1

  def encode(self, text: str) -> list[int]:
    # add_special_tokens=False: no template BOS/EOS of the tokenizer's own; add_bos/add_eos decide those. A special
    # token spelled out in the text still becomes its id, as in transformers.
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """encode(text) and each token's [start, end) character span in `text` (chat masks are found by characters)."""
    encoding = self._tok.encode(text, add_special_tokens=False)
    return encoding.ids, encoding.offsets

  def decode(self, ids: Iterable[int]) -> str:
    # Special tokens are kept, so decode(encode(text)) == text even when the text spells one out.
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
