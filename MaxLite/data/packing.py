"""Packing of tokenized documents into fixed-length rows (pure numpy, no grain).

Targets are defined per document, before packing: a document of tokens [t0, ..., tn] becomes the
pairs inputs = [t0 .. t(n-1)], targets = [t1 .. tn]. Only the pairs are packed, so a target never
crosses a document boundary and no extra masking is needed at segment ends; the last token of a
document (EOS when add_eos) is a target but never an input, the first (BOS) an input but never a
target. Documents with fewer than 2 tokens have no pair and are dropped.

Packing is concat-then-split and greedy: each row is filled to the end with the next pairs in
stream order. A document that does not fit in what is left of a row is split; its remainder opens
the next row (so documents longer than a row become consecutive chunks, no token dropped). Every
piece of a document in a row is one segment: segment ids 1, 2, 3 ... within the row (0 = padding,
only in the last row of a finite stream), positions restart at 0 in each segment, including a
continuation chunk (it cannot attend to the previous row, so its positions carry no information
about it). Rows therefore contain no padding except at the very end of the stream, or where a cap on the
segments of a row (max_segments_per_seq; cuDNN's packed attention has a fixed count) closes a row early.

A document may come with a loss mask (post-training: 1 on the tokens to learn, e.g. the assistant's reply):
a target is learned when its token's mask is 1, and targets_segmentation is 0 where it is not, so the
prompt is attended to but not trained on. A group of documents (a DPO pair: chosen, then rejected) is
placed whole in one row as consecutive segments; when it does not fit in what is left of a row the row
is closed with padding, and a group longer than a whole row keeps the first seq_len // n pairs of each
of its n documents.

Between rows the packer's only leftover is one partially consumed document (or one group not yet
placed), so its checkpoint is "which document" (the caller's source position) plus `offset`, the number
of pairs already emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np

from MaxLite.data import BATCH_KEYS


class Masked(NamedTuple):
  """A document with its loss mask (1 = learn this token)."""

  tokens: np.ndarray
  mask: np.ndarray


class Group(tuple):
  """Documents packed whole into one row, as consecutive segments (a DPO pair: chosen, then rejected)."""


Document = Sequence[int] | np.ndarray | Masked
Item = Document | Group
_Pairs = tuple[np.ndarray, np.ndarray, np.ndarray]  # inputs, targets, 1 where the target is learned


def document_pairs(document: Document) -> _Pairs:
  """(inputs, targets, learned) of one document: next-token prediction shifted within the document."""
  if isinstance(document, Masked):
    tokens, mask = (np.asarray(a, dtype=np.int32) for a in document)
  else:
    tokens = np.asarray(document, dtype=np.int32)
    mask = np.ones_like(tokens)
  if tokens.ndim != 1 or mask.shape != tokens.shape:
    raise ValueError(f"a document must be a 1-D token list (with a mask of its shape), got shape {tokens.shape}")
  return tokens[:-1], tokens[1:], mask[1:]


def _group_pairs(group: Group, seq_len: int) -> list[_Pairs]:
  """The documents of a group with pairs, each cut to seq_len // n pairs when all of them do not fit in a row."""
  pairs = [p for p in map(document_pairs, group) if len(p[0])]
  if sum(len(p[0]) for p in pairs) > seq_len:
    keep = seq_len // len(pairs)
    pairs = [tuple(a[:keep] for a in p) for p in pairs]
  return pairs


def empty_row(seq_len: int) -> dict[str, np.ndarray]:
  """A row of pure padding (all zeros, segmentation 0)."""
  return {k: np.zeros((seq_len,), np.int32) for k in BATCH_KEYS}


class StreamingPacker:
  """Builds rows one at a time from a pull-based stream of documents and groups (see module docstring).

  `next_row(pull)` calls `pull()` for more items (None = stream exhausted) until the row is full. What is
  left over is kept as (pending pairs, offset); `restore(item, offset)` re-creates it after a restart from
  the re-read item.
  """

  def __init__(self, seq_len: int, max_segments: int = -1):
    if seq_len < 1:
      raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if max_segments == 0 or max_segments < -1:
      raise ValueError(f"max_segments must be -1 (no cap) or >= 1, got {max_segments}")
    self.seq_len = seq_len
    self.max_segments = max_segments if max_segments > 0 else seq_len
    self._pending: list[_Pairs] | None = None  # one document's pairs, or a group's
    self._grouped = False
    self._offset = 0
    self._exhausted = False

  @property
  def has_pending(self) -> bool:
    """True when an item has been pulled but not all of its pairs emitted."""
    return self._pending is not None

  @property
  def offset(self) -> int:
    """Pairs of the pending document already emitted (0 when nothing is pending, and for a group)."""
    return self._offset

  def reset(self) -> None:
    self._pending, self._grouped, self._offset, self._exhausted = None, False, 0, False

  def _hold(self, item: Item) -> bool:
    """Makes `item` the pending one; False when it has nothing to predict."""
    self._grouped = isinstance(item, Group)
    pending = _group_pairs(item, self.seq_len) if self._grouped else [document_pairs(item)]
    if not pending or not len(pending[0][0]):
      return False
    self._pending, self._offset = pending, 0
    return True

  def restore(self, item: Item, offset: int) -> None:
    """Makes `item` pending with its first `offset` pairs already emitted."""
    self.reset()
    if self._hold(item) and not 0 <= offset < (1 if self._grouped else len(self._pending[0][0])):
      raise ValueError(f"offset {offset} out of range for a document of {len(self._pending[0][0])} pairs")
    if self._pending is not None:
      self._offset = offset

  def _place(self, row: dict[str, np.ndarray], filled: int, segment: int, pairs: _Pairs, start: int, take: int) -> None:
    inputs, targets, learned = pairs
    span = slice(filled, filled + take)
    row["inputs"][span] = inputs[start : start + take]
    row["targets"][span] = targets[start : start + take]
    row["inputs_position"][span] = np.arange(take, dtype=np.int32)
    row["inputs_segmentation"][span] = segment
    row["targets_segmentation"][span] = segment * learned[start : start + take]

  def next_row(self, pull: Callable[[], Item | None]) -> dict[str, np.ndarray] | None:
    """The next full row; a padded last row at the end of the stream; None once nothing is left."""
    row = empty_row(self.seq_len)
    filled, segment = 0, 0
    while filled < self.seq_len and segment < self.max_segments:
      if self._pending is None:
        if self._exhausted:
          break
        item = pull()
        if item is None:
          self._exhausted = True
          break
        if not self._hold(item):
          continue  # fewer than 2 tokens: nothing to predict
      if self._grouped:
        too_many = segment + len(self._pending) > self.max_segments
        if too_many and segment == 0:
          raise ValueError(
            f"a group of {len(self._pending)} documents cannot fit a row of {self.max_segments} segments"
          )
        if too_many or sum(len(p[0]) for p in self._pending) > self.seq_len - filled:
          break  # the group opens the next row
        for pairs in self._pending:
          segment += 1
          self._place(row, filled, segment, pairs, 0, len(pairs[0]))
          filled += len(pairs[0])
        self._pending = None
        continue
      pairs = self._pending[0]
      take = min(len(pairs[0]) - self._offset, self.seq_len - filled)
      segment += 1
      self._place(row, filled, segment, pairs, self._offset, take)
      filled += take
      self._offset += take
      if self._offset == len(pairs[0]):
        self._pending, self._offset = None, 0
    if filled == 0:
      return None
    return row


def pack_documents(documents: Iterable[Item], seq_len: int, max_segments: int = -1) -> dict[str, np.ndarray]:
  """Packs a finite list of documents and groups into int32 arrays [rows, seq_len] (see module docstring)."""
  it = iter(documents)
  packer = StreamingPacker(seq_len, max_segments)
  rows = []
  while (row := packer.next_row(lambda: next(it, None))) is not None:
    rows.append(row)
  if not rows:
    return {k: np.zeros((0, seq_len), np.int32) for k in BATCH_KEYS}
  return {k: np.stack([r[k] for r in rows]) for k in BATCH_KEYS}
