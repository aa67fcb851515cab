"""Grain input pipeline: ArrayRecord documents -> this process's shard -> shuffle -> tokenize -> pack -> batch.

    source[shard_index::shard_count] -> shuffle(seed) -> repeat(num_epochs) -> map(tokenize)
      -> to_iter_dataset (thread prefetch) -> pack (packing.StreamingPacker) -> batch -> [mp_prefetch]

Everything up to tokenization is a grain MapDataset, i.e. a pure function of the record index, so
the iterator state is a few integers: the next document index of the parent, plus for the packer
the index of the document it is in the middle of and how many of its tokens it already emitted.
Restoring re-reads and re-tokenizes that one document; no data is ever stored in the state.

Sharding is by record: shard i of n reads records r with r % n == i of the concatenated files, so
the shards partition every epoch. Each shard shuffles its own records (same seed; a new permutation
each epoch) and packs them independently, so no process ever reads another process's records.
"""

from __future__ import annotations

import bisect
import copy
from typing import Any

import grain
import numpy as np
from absl import flags
from array_record.python.array_record_module import ArrayRecordReader

from MaxLite.data import BATCH_KEYS
from MaxLite.data.packing import StreamingPacker, empty_row
from MaxLite.data.tokenizer import Tokenizer, load_tokenizer
from MaxLite.errors import ConfigError, InputError, first_line
from MaxLite.paths import expand_globs

# Documents tokenized ahead by grain's reader threads. 2 threads measured fastest on 2 cores
# (16, grain's default, is ~25% slower); each buffered element holds one tokenized document.
_READ_THREADS = 2
_PREFETCH_DOCUMENTS = 64


def resolve_files(files: str) -> list[tuple[str, int]]:
  """(path, record count) of every ArrayRecord file the globs name; InputError for none / unreadable."""
  paths = expand_globs(files, "data files (grain_train_files / grain_eval_files)")
  out = []
  for path in paths:
    try:
      reader = ArrayRecordReader(path)
      out.append((path, reader.num_records()))
      reader.close()
    except Exception as e:  # the C++ reader raises plain RuntimeError
      raise InputError(f"data files: not a readable ArrayRecord file: {path} ({first_line(e)})") from None
  return out


class _CheckedSource:
  """grain's ArrayRecordDataSource, but a read failure becomes an InputError naming the file."""

  def __init__(self, files: list[tuple[str, int]]):
    self._files = files
    self._ends = list(np.cumsum([n for _, n in files]))
    # "path[start:stop]" tells grain the record count, so it does not open every file again.
    self._source = grain.sources.ArrayRecordDataSource([f"{p}[0:{n}]" for p, n in files])

  def __len__(self) -> int:
    return int(self._ends[-1]) if self._ends else 0

  def __getitem__(self, index: int) -> bytes:
    try:
      return self._source[index]
    except Exception as e:
      path = self._files[bisect.bisect_right(self._ends, index)][0]
      raise InputError(f"data files: cannot read record from {path} ({first_line(e)})") from None


class _Tokenize(grain.transforms.Map):
  """UTF-8 document bytes -> int32 token ids, optionally framed by BOS/EOS."""

  def __init__(self, tokenizer: Tokenizer, add_bos: bool, add_eos: bool):
    self._tok, self._bos, self._eos = tokenizer, add_bos, add_eos

  def map(self, element: bytes) -> np.ndarray:
    ids = self._tok.encode(element.decode("utf-8", errors="replace"))
    if self._bos:
      ids.insert(0, self._tok.bos_id)
    if self._eos:
      ids.append(self._tok.eos_id)
    return np.asarray(ids, dtype=np.int32)


class _PackDatasetIterator(grain.DatasetIterator):
  """Rows from a document iterator; state = parent state at the pending document + its offset."""

  def __init__(self, parent: grain.DatasetIterator, seq_len: int):
    super().__init__(parent)
    self._packer = StreamingPacker(seq_len)
    self._pending_state: dict[str, Any] | None = None

  def _pull(self) -> np.ndarray | None:
    state = self._parent.get_state()  # position *before* the document, to re-read it on restore
    try:
      doc = next(self._parent)
    except StopIteration:
      return None
    self._pending_state = state
    return doc

  def __next__(self) -> dict[str, np.ndarray]:
    row = self._packer.next_row(self._pull)
    if row is None:
      raise StopIteration
    return row

  def get_state(self) -> dict[str, Any]:
    if self._packer.has_pending:
      return {"parent": copy.deepcopy(self._pending_state), "offset": self._packer.offset}
    return {"parent": self._parent.get_state(), "offset": 0}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._packer.reset()
    self._pending_state = None
    if state["offset"]:
      doc = self._pull()
      if doc is None:
        raise InputError("data iterator state points past the end of the data files")
      self._packer.restore(doc, int(state["offset"]))


class _PackIterDataset(grain.IterDataset):
  """Concat-then-split packing of token arrays into rows (see MaxLite/data/packing.py)."""

  def __init__(self, parent: grain.IterDataset, seq_len: int):
    super().__init__(parent)
    self._seq_len = seq_len

  def __iter__(self) -> _PackDatasetIterator:
    return _PackDatasetIterator(self._parent.__iter__(), self._seq_len)

  def __str__(self) -> str:
    return f"PackIterDataset(seq_len={self._seq_len})"


class _StackRows:
  """grain batch_fn: stacks rows; a short last batch (finite epochs) is padded with empty rows."""

  def __init__(self, batch_size: int, seq_len: int):
    self._batch_size, self._seq_len = batch_size, seq_len

  def __call__(self, rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    rows = list(rows) + [empty_row(self._seq_len) for _ in range(self._batch_size - len(rows))]
    return {k: np.stack([r[k] for r in rows]).astype(np.int32, copy=False) for k in BATCH_KEYS}


def make_grain_iterator(
  files: str,
  *,
  tokenizer_path: str,
  seq_len: int,
  batch_size: int,
  shard_index: int,
  shard_count: int,
  seed: int,
  add_bos: bool,
  add_eos: bool,
  shuffle: bool = True,
  num_epochs: int | None = None,
  worker_count: int = 0,
) -> grain.DatasetIterator:
  """Iterator of dicts of int32 arrays [batch_size, seq_len] (keys: data.BATCH_KEYS) for this shard.

  `files`: glob or comma-separated globs of ArrayRecord files of UTF-8 documents. num_epochs=None
  repeats forever; with a finite count the last batch is padded with segmentation-0 rows and then
  StopIteration. get_state()/set_state() restore exactly the next batch in a fresh iterator.
  """
  if seq_len < 1 or batch_size < 1:
    raise ConfigError(f"seq_len and batch_size must be >= 1, got seq_len={seq_len} batch_size={batch_size}")
  if not 0 <= shard_index < shard_count:
    raise ConfigError(f"shard_index must be in [0, shard_count={shard_count}), got {shard_index}")
  if num_epochs is not None and num_epochs < 1:
    raise ConfigError(f"num_epochs must be None (forever) or >= 1, got {num_epochs}")
  if worker_count < 0:
    raise ConfigError(f"grain_worker_count must be >= 0, got {worker_count}")
  tokenizer = load_tokenizer(tokenizer_path)
  source = _CheckedSource(resolve_files(files))
  if len(source) < shard_count:
    raise InputError(f"data files {files!r} hold {len(source)} records, fewer than the {shard_count} data shards")

  ds = grain.MapDataset.source(source)[shard_index::shard_count]
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs).map(_Tokenize(tokenizer, add_bos, add_eos))
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=_READ_THREADS, prefetch_buffer_size=_PREFETCH_DOCUMENTS))
  it = _PackIterDataset(it, seq_len).batch(batch_size, batch_fn=_StackRows(batch_size, seq_len))
  if worker_count > 0:
    # grain's worker processes read absl flags; a non-absl program (ours) never parses them.
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
  return iter(it)
