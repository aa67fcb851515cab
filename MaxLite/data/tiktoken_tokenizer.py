"""tokenizer_type=tiktoken: Llama 3's tokenizer as Meta ships it (original/tokenizer.model): a tiktoken BPE file of
one base64 token and its rank per line, Llama 3's pre-tokenizer pattern, and 256 special tokens numbered after
the ranks. With Meta's 128,000 ranks that gives <|begin_of_text|> = 128000, <|end_of_text|> = 128001 and a
vocabulary of 128,256: the numbering of the Llama 3.x weights and of their Hugging Face tokenizer.json.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Iterator

import tiktoken

from MaxLite import storage
from MaxLite.cli.errors import InputError

# Llama 3's split of text into pre-tokens before BPE (the cl100k pattern).
PATTERN = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_SPECIAL_TOKENS = 256
# Llama 3.1's named special tokens, in id order from the first id after the ranks; reserved tokens fill the
# rest of the 256, numbered on from the two reserved names used here.
_NAMED_SPECIAL = (
  "<|begin_of_text|>",
  "<|end_of_text|>",
  "<|reserved_special_token_0|>",
  "<|reserved_special_token_1|>",
  "<|finetune_right_pad_id|>",
  "<|step_id|>",
  "<|start_header_id|>",
  "<|end_header_id|>",
  "<|eom_id|>",
  "<|eot_id|>",
  "<|python_tag|>",
)
# tiktoken's merge loop grows with the square of one pre-token's length, so Meta's reference encodes text in
# pieces of 400,000 characters and cuts runs of more than 25,000 whitespace or non-whitespace characters; this
# does the same, so the ids equal the reference's for any text.
_MAX_PIECE_CHARS = 400_000
_MAX_RUN = 25_000
_LONG_RUN = re.compile(rf"\s{{{_MAX_RUN + 1},}}|\S{{{_MAX_RUN + 1},}}")


def special_tokens(first_id: int) -> dict[str, int]:
  """Llama 3's 256 special tokens, numbered from `first_id` (= the number of BPE ranks)."""
  reserved = NUM_SPECIAL_TOKENS - len(_NAMED_SPECIAL)
  names = list(_NAMED_SPECIAL) + [f"<|reserved_special_token_{2 + i}|>" for i in range(reserved)]
  return {name: first_id + i for i, name in enumerate(names)}


def _bad_file(path: str, why: str) -> InputError:
  return InputError(f"tokenizer_path: not a tiktoken BPE file (a base64 token and its rank per line): {path!r}: {why}")


def read_ranks(path: str) -> dict[bytes, int]:
  """The BPE ranks of a tiktoken file, the format tiktoken.load.load_tiktoken_bpe reads. Read through
  MaxLite.storage rather than by that function: it fetches gs:// only through blobfile, and it caches a file's
  contents under /tmp by path name, so a file replaced at the same path would load its old ranks."""
  ranks: dict[bytes, int] = {}
  for number, line in enumerate(storage.read_bytes(path).splitlines(), 1):
    if not line.strip():
      continue
    try:
      token, rank = line.split()
      ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, binascii.Error):
      raise _bad_file(path, f"line {number} is not `base64 rank`") from None
  if sorted(ranks.values()) != list(range(len(ranks))):
    raise _bad_file(path, f"the ranks are not 0..{len(ranks) - 1}, each once")
  missing = [b for b in range(256) if bytes([b]) not in ranks]
  if missing:
    # tiktoken cannot encode a byte without a rank of its own (it panics mid-document).
    raise _bad_file(path, f"{len(missing)} single bytes have no rank (the first is {missing[0]})")
  return ranks


def _pieces(text: str) -> Iterator[str]:
  for start in range(0, len(text), _MAX_PIECE_CHARS):
    chunk, cut = text[start : start + _MAX_PIECE_CHARS], 0
    for run in _LONG_RUN.finditer(chunk):
      for end in range(run.start() + _MAX_RUN, run.end(), _MAX_RUN):
        yield chunk[cut:end]
        cut = end
    yield chunk[cut:]


class TiktokenTokenizer:
  """A tiktoken.Encoding built like Meta's Llama 3 tokenizer. Picklable (tiktoken pickles the ranks)."""

  def __init__(self, path: str):
    self.path = path
    ranks = read_ranks(path)
    special = special_tokens(len(ranks))
    self._encoding = tiktoken.Encoding(
      name="maxlite_llama3", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=special
    )
    self.vocab_size = self._encoding.n_vocab
    self.bos_id, self.eos_id = special["<|begin_of_text|>"], special["<|end_of_text|>"]
    self.pad_id = special["<|finetune_right_pad_id|>"]  # Meta's pad id; MaxLite pads with segmentation 0

  def encode(self, text: str) -> list[int]:
    # disallowed_special=(): text that spells a special token ("<|eot_id|>") is ordinary text, as in Meta's
    # reference; only add_bos/add_eos put special ids in the data.
    return [i for piece in _pieces(text) for i in self._encoding.encode(piece, disallowed_special=())]

  def decode(self, ids: Iterable[int]) -> str:
    return self._encoding.decode([int(i) for i in ids])
