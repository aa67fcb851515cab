"""Grain input pipeline: documents of files -> one packed stream per global batch row -> this process's rows.

    records r with r % num_slots == slot -> shuffle(seed, slot) -> repeat -> tokenize   (a grain MapDataset)
      -> pack (packing.StreamingPacker) -> one row per step for that slot

The global batch has `num_slots` rows (the global batch size). Row slot s owns the records whose index
(in the concatenated files) is s modulo num_slots, reads them in its own shuffled order (a new permutation
each epoch) and packs them into its own rows. Batch k is row k of every slot. So the sequence of global
batches depends only on the files, tokenizer, seed, sequence length, global batch size and packing, never on
how many processes read it, the mesh, or the device order: a process builds exactly the slots its devices
hold, and nobody reads another slot's records.

The files are ArrayRecord, Parquet or JSONL (sources.py: document i of the concatenated files, by random
access); the same documents in any of them give the same batches. Post-training records (conversations,
prompt/completion, preference pairs: `Records`) replace tokenization with records.EncodeRecord, which gives
documents with loss masks and DPO pairs that the packer keeps whole.

Everything up to tokenization is random access (a pure function of the index), so a slot's state is two
integers: the index of the document it is in the middle of (or the next one) and how many of its pairs were
already emitted. The iterator's state is {slot: [index, offset]} for its slots plus num_slots; states of
several processes merge into one dict, and any other topology restores its own slots from it. The state also
holds a fingerprint of the tokenizer and chat template, so a resume that would tokenize differently is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from MaxLite import storage
from MaxLite.cli.errors import ConfigError, InputError
from MaxLite.data import BATCH_KEYS
from MaxLite.data.chat import ChatTemplate
from MaxLite.data.packing import StreamingPacker, empty_row
from MaxLite.data.records import EncodeRecord
from MaxLite.data.sources import open_records, open_source
from MaxLite.data.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class Records:
  """Post-training records instead of text documents: `kind` as config.post_training.data_kind, the `columns` to
  read, the chat template (use_chat_template) and whether only responses are learned."""

  kind: str
  columns: Sequence[str]
  use_chat_template: bool = False
  chat_template_path: str = ""
  completion_only: bool = False


def _fingerprint(tokenizer_path: str, template: ChatTemplate | None) -> str:
  """What tokenization depends on beyond the keys a resume compares: the contents of the tokenizer's files and of
  the chat template (an edited file under the same name would change every row)."""
  digest = hashlib.sha256()
  if storage.isdir(tokenizer_path):
    files = [storage.join(tokenizer_path, name) for name in ("tokenizer.json", "tokenizer_config.json")]
  else:
    files = [tokenizer_path]
  for path in files:
    digest.update(storage.read_bytes(path) if storage.isfile(path) else b"-")
  if template is not None:
    digest.update(template.source.encode("utf-8"))
  return digest.hexdigest()[:16]


class _Tokenize(grain.transforms.Map):
  """A document (UTF-8 bytes or str, as the source gives it) -> int32 token ids, optionally framed by BOS/EOS.
  A tokenizer without a BOS (Qwen) or EOS gets none: add_bos/add_eos then add nothing (-1 is no embedding row)."""

  def __init__(self, tokenizer: Tokenizer, add_bos: bool, add_eos: bool):
    self._tok = tokenizer
    self._bos = add_bos and tokenizer.bos_id >= 0
    self._eos = add_eos and tokenizer.eos_id >= 0

  def map(self, element: bytes | str) -> np.ndarray:
    text = element if isinstance(element, str) else element.decode("utf-8", errors="replace")
    ids = self._tok.encode(text)
    if self._bos:
      ids.insert(0, self._tok.bos_id)
    if self._eos:
      ids.append(self._tok.eos_id)
    return np.asarray(ids, dtype=np.int32)


def _slot_seed(seed: int, slot: int) -> int:
  """Each slot shuffles with its own seed, so equal-sized slots do not share one permutation."""
  return int(np.random.SeedSequence([seed, slot]).generate_state(1)[0])


class _SlotStream:
  """The packed rows of one batch slot; state = (document index, pairs of it already emitted)."""

  def __init__(self, documents: grain.MapDataset, seq_len: int, max_segments: int, limit: int | None):
    self._documents, self._limit = documents, limit
    self._packer = StreamingPacker(seq_len, max_segments)
    self._next = 0  # index of the next document to pull
    self._pending = 0  # index of the document the packer holds, if any

  def _pull(self) -> np.ndarray | None:
    if self._limit is not None and self._next >= self._limit:
      return None
    self._pending = self._next
    self._next += 1
    return self._documents[self._pending]

  def next_row(self) -> dict[str, np.ndarray] | None:
    return self._packer.next_row(self._pull)

  def get_state(self) -> list[int]:
    if self._packer.has_pending:
      return [self._pending, self._packer.offset]
    return [self._next, 0]

  def set_state(self, state: list[int]) -> None:
    index, offset = (int(v) for v in state)
    self._packer.reset()
    self._next = index
    if offset:
      doc = self._pull()
      if doc is None:
        raise InputError("data iterator state points past the end of the data files")
      self._packer.restore(doc, offset)


class SlotBatchIterator:
  """Batches of this process's rows: row i is the next row of slot `slots[i]` (see module docstring)."""

  def __init__(
    self,
    streams: dict[int, _SlotStream],
    slots: list[int],
    num_slots: int,
    seq_len: int,
    workers: int,
    fingerprint: str = "",
  ):
    self._streams, self._slots, self._num_slots, self._seq_len = streams, slots, num_slots, seq_len
    self._fingerprint = fingerprint
    self._unique = sorted(streams)
    # Slots are independent, so threads may fill them at once without changing any row.
    self._pool = ThreadPoolExecutor(workers) if workers > 0 else None

  def __iter__(self) -> SlotBatchIterator:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._pool is None:
      rows = {slot: self._streams[slot].next_row() for slot in self._unique}
    else:
      rows = dict(zip(self._unique, self._pool.map(lambda slot: self._streams[slot].next_row(), self._unique)))
    if all(row is None for row in rows.values()):
      raise StopIteration
    ordered = [rows[slot] if rows[slot] is not None else empty_row(self._seq_len) for slot in self._slots]
    return {k: np.stack([r[k] for r in ordered]).astype(np.int32, copy=False) for k in BATCH_KEYS}

  def get_state(self) -> dict[str, Any]:
    return {
      "num_slots": self._num_slots,
      "tokenization": self._fingerprint,
      "slots": {str(s): self._streams[s].get_state() for s in self._unique},
    }

  def set_state(self, state: dict[str, Any]) -> None:
    """Takes this process's slots from a state that holds them (a merge of any processes' states)."""
    if "slots" not in state:
      raise InputError("the saved data position is from an older MaxLite data format; start a new data stream")
    if int(state["num_slots"]) != self._num_slots:
      raise InputError(
        f"the saved data position is for a global batch of {state['num_slots']} rows, this run has "
        f"{self._num_slots}; the data stream cannot continue exactly"
      )
    saved = state.get("tokenization")  # absent in states saved before it was recorded
    if saved is not None and saved != self._fingerprint:
      raise InputError(
        "the tokenizer files or the chat template changed since the saved data position was written, so the "
        "rows would differ; restore them, or start a new run_name with load_full_state_path"
      )
    missing = [s for s in self._unique if str(s) not in state["slots"]]
    if missing:
      raise InputError(f"the saved data position has no state for batch rows {missing[:8]}")
    for slot in self._unique:
      self._streams[slot].set_state(state["slots"][str(slot)])

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=False)


def make_grain_iterator(
  files: str,
  *,
  tokenizer_path: str,
  seq_len: int,
  num_slots: int,
  slots: list[int] | tuple[int, ...],
  max_segments: int = -1,
  seed: int,
  add_bos: bool,
  add_eos: bool,
  shuffle: bool = True,
  num_epochs: int | None = None,
  worker_count: int = 0,
  tokenizer_type: str = "sentencepiece",
  file_type: str = "arrayrecord",
  text_column: str = "text",
  records: Records | None = None,
) -> SlotBatchIterator:
  """Iterator of dicts of int32 arrays [len(slots), seq_len] (keys: data.BATCH_KEYS): rows `slots` of each
  global batch of `num_slots` rows.

  `files`: glob or comma-separated globs of `file_type` files (sources.FILE_TYPES; `text_column` names the text
  of Parquet rows / JSONL objects). num_epochs=None repeats forever; with a finite count an exhausted slot yields
  segmentation-0 rows until every slot is exhausted, then StopIteration. get_state()/set_state() restore exactly
  the next batch in a fresh iterator. `worker_count` threads fill the slots (the rows do not depend on it).
  `tokenizer_type`: see data/tokenizer.py. `records`: post-training records instead of `text_column`'s documents.
  `max_segments`: at most this many documents (pieces) in a row, -1 = no cap (max_segments_per_seq).
  """
  if seq_len < 1 or num_slots < 1 or not slots:
    raise ConfigError(f"seq_len, num_slots and slots must be positive, got {seq_len}, {num_slots}, {list(slots)}")
  if not all(0 <= s < num_slots for s in slots):
    raise ConfigError(f"batch rows must be in [0, {num_slots}), got {list(slots)}")
  if num_epochs is not None and num_epochs < 1:
    raise ConfigError(f"num_epochs must be None (forever) or >= 1, got {num_epochs}")
  if worker_count < 0:
    raise ConfigError(f"grain_worker_count must be >= 0, got {worker_count}")
  tokenizer = load_tokenizer(tokenizer_path, tokenizer_type)
  template = None
  if records is None:
    source, encode = open_source(files, file_type, text_column), _Tokenize(tokenizer, add_bos, add_eos)
  else:
    if records.use_chat_template:
      template = ChatTemplate.load(tokenizer_path, records.chat_template_path)
    source = open_records(files, file_type, records.columns)
    encode = EncodeRecord(records.kind, tokenizer, template, records.completion_only, add_bos, add_eos)
  if len(source) < num_slots:
    raise InputError(
      f"data files {files!r} hold {len(source)} records, fewer than the {num_slots} rows of a global batch "
      "(each row reads its own records)"
    )
  streams = {}
  for slot in sorted(set(slots)):
    docs = grain.MapDataset.source(source)[slot::num_slots]
    per_epoch = len(docs)
    if shuffle:
      docs = docs.shuffle(seed=_slot_seed(seed, slot))
    docs = docs.repeat(num_epochs).map(encode)
    streams[slot] = _SlotStream(docs, seq_len, max_segments, None if num_epochs is None else per_epoch * num_epochs)
  fingerprint = _fingerprint(tokenizer_path, template)
  return SlotBatchIterator(streams, list(slots), num_slots, seq_len, worker_count, fingerprint)
