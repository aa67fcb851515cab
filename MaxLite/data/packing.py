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
about it). Rows therefore contain no padding except at the very end of the stream.

Between rows the packer's only leftover is one partially consumed document, so its checkpoint is
"which document" (the caller's source position) plus `offset`, the number of pairs already emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from MaxLite.data import BATCH_KEYS


def document_pairs(tokens: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, targets) of one document: next-token prediction shifted within the document."""
  toks = np.asarray(tokens, dtype=np.int32)
  if toks.ndim != 1:
    raise ValueError(f"a document must be a 1-D token list, got shape {toks.shape}")
  return toks[:-1], toks[1:]


def empty_row(seq_len: int) -> dict[str, np.ndarray]:
  """A row of pure padding (all zeros, segmentation 0)."""
  return {k: np.zeros((seq_len,), np.int32) for k in BATCH_KEYS}


class StreamingPacker:
  """Builds rows one at a time from a pull-based stream of documents.

  `next_row(pull)` calls `pull()` for more documents (token sequences; None = stream exhausted)
  until the row is full. The one document left partially consumed is kept as (pairs, offset);
  `restore(tokens, offset)` re-creates that leftover after a restart from the re-read document.
  """

  def __init__(self, seq_len: int):
    if seq_len < 1:
      raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    self.seq_len = seq_len
    self._pending: tuple[np.ndarray, np.ndarray] | None = None
    self._offset = 0
    self._exhausted = False

  @property
  def has_pending(self) -> bool:
    """True when a document has been pulled but not all of its pairs emitted."""
    return self._pending is not None

  @property
  def offset(self) -> int:
    """Pairs of the pending document already emitted (0 when nothing is pending)."""
    return self._offset

  def reset(self) -> None:
    self._pending, self._offset, self._exhausted = None, 0, False

  def restore(self, tokens: Sequence[int] | np.ndarray, offset: int) -> None:
    """Makes `tokens` the pending document with its first `offset` pairs already emitted."""
    self.reset()
    inputs, targets = document_pairs(tokens)
    if not 0 <= offset < max(len(inputs), 1):
      raise ValueError(f"offset {offset} out of range for a document of {len(inputs)} pairs")
    if len(inputs):
      self._pending, self._offset = (inputs, targets), offset

  def next_row(self, pull: Callable[[], Sequence[int] | np.ndarray | None]) -> dict[str, np.ndarray] | None:
    """The next full row; a padded last row at the end of the stream; None once nothing is left."""
    row = empty_row(self.seq_len)
    filled, segment = 0, 0
    while filled < self.seq_len:
      if self._pending is None:
        if self._exhausted:
          break
        tokens = pull()
        if tokens is None:
          self._exhausted = True
          break
        inputs, targets = document_pairs(tokens)
        if not len(inputs):
          continue  # fewer than 2 tokens: nothing to predict
        self._pending, self._offset = (inputs, targets), 0
      inputs, targets = self._pending
      take = min(len(inputs) - self._offset, self.seq_len - filled)
      segment += 1
      span = slice(filled, filled + take)
      row["inputs"][span] = inputs[self._offset : self._offset + take]
      row["targets"][span] = targets[self._offset : self._offset + take]
      row["inputs_position"][span] = np.arange(take, dtype=np.int32)
      row["inputs_segmentation"][span] = segment
      filled += take
      self._offset += take
      if self._offset == len(inputs):
        self._pending, self._offset = None, 0
    if filled == 0:
      return None
    row["targets_segmentation"][:] = row["inputs_segmentation"]
    return row


def pack_documents(documents: Iterable[Sequence[int] | np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
  """Packs a finite list of token lists into int32 arrays [rows, seq_len] (see module docstring)."""
  it = iter(documents)
  packer = StreamingPacker(seq_len)
  rows = []
  while (row := packer.next_row(lambda: next(it, None))) is not None:
    rows.append(row)
  if not rows:
    return {k: np.zeros((0, seq_len), np.int32) for k in BATCH_KEYS}
  return {k: np.stack([r[k] for r in rows]) for k in BATCH_KEYS}
