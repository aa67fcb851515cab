"""Generated batches with learnable structure, for benchmarks and tests without data files.

Each row repeats a short random pattern (4 to 16 tokens drawn from a Zipf-like distribution over
the vocabulary). A model first learns the skewed unigram distribution, then to copy the pattern
from its context, so the loss falls well below log(vocab). The contents depend only on
(seed, step, row), so any process can produce exactly its own rows.

tokens="uniform" draws every id independently and uniformly instead, as MaxText's synthetic data does: nothing to
learn, but the same data as a MaxText benchmark. The distribution matters to speed: the embedding gradient is a
scatter-add, and Zipf-drawn ids pile onto a few rows (a quarter of the patterns' ids are id 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

_MAX_PERIOD = 16


class SyntheticIterator:
  """Yields the given rows of each global batch as int32 numpy arrays [len(rows), seq]."""

  def __init__(
    self, *, global_batch: int, rows: Sequence[int], seq_len: int, vocab_size: int, seed: int, tokens: str = "patterns"
  ):
    self._global_batch, self._rows, self._uniform = global_batch, list(rows), tokens == "uniform"
    self._seq_len, self._vocab, self._seed = seq_len, vocab_size, seed
    self._step = 0

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self._seed, self._step])
    if self._uniform:
      every_row = rng.integers(0, self._vocab, size=(self._global_batch, self._seq_len + 1))
      return self._batch(every_row[self._rows].astype(np.int32))
    patterns = (rng.zipf(1.3, size=(self._global_batch, _MAX_PERIOD)) - 1) % self._vocab
    periods = rng.integers(4, _MAX_PERIOD + 1, size=(self._global_batch, 1))
    offsets = np.arange(self._seq_len + 1) % periods  # [batch, seq + 1]
    return self._batch(np.take_along_axis(patterns, offsets, axis=1)[self._rows].astype(np.int32))

  def _batch(self, tokens: np.ndarray) -> dict[str, np.ndarray]:
    self._step += 1
    rows = tokens.shape[0]
    ones = np.ones((rows, self._seq_len), np.int32)
    positions = np.broadcast_to(np.arange(self._seq_len, dtype=np.int32), (rows, self._seq_len)).copy()
    return {
      "inputs": tokens[:, :-1],
      "targets": tokens[:, 1:],
      "inputs_position": positions,
      "inputs_segmentation": ones,
      "targets_segmentation": ones.copy(),
    }

  def get_state(self) -> dict[str, Any]:
    return {"step": self._step}

  def set_state(self, state: dict[str, Any]) -> None:
    self._step = int(state["step"])
