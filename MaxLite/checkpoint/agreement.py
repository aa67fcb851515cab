"""Decisions every process of a job takes together: which steps exist and whether each could read one.

Two hosts that resume from different steps train on different data with different weights, and the job
either hangs in its first collective or silently goes wrong. So what one process sees (a listing, a read
error) is shared before anyone acts on it. Single-process runs skip the collectives.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def _gather(values: np.ndarray) -> np.ndarray:
  """[process_count, *values.shape]: every process's `values`, in process order (same shape on all)."""
  return np.asarray(multihost_utils.process_allgather(values))


def process_0s(values: list[int]) -> list[int]:
  """Process 0's `values` on every process (lists may differ in length across processes)."""
  if jax.process_count() == 1:
    return list(values)
  lengths = _gather(np.array([len(values)], np.int64))[:, 0]
  if lengths.max() == 0:
    return []
  padded = np.full(int(lengths.max()), -1, np.int64)
  padded[: len(values)] = values
  return [int(v) for v in _gather(padded)[0, : int(lengths[0])]]


def everyones(value: int) -> list[int]:
  """Each process's `value`, in process order."""
  if jax.process_count() == 1:
    return [value]
  return [int(v) for v in _gather(np.array([value], np.int64))[:, 0]]
