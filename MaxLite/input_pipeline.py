"""This process's rows of each batch -> global jax arrays sharded on the batch mesh axes.

Every input source (synthetic, grain) produces only the rows whose devices live in this process;
`jax.make_array_from_process_local_data` stitches them into one global array per key.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Iterator

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from MaxLite.config import Config
from MaxLite.errors import ConfigError
from MaxLite.data.synthetic import SyntheticIterator
from MaxLite.sharding import batch_sharding

BATCH_KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _repo_relative(pattern: str) -> str:
  """A relative path or glob that matches nothing from the cwd is looked up under the repo root,
  so the shipped defaults work from any directory."""
  if not pattern or os.path.isabs(pattern) or glob.glob(pattern):
    return pattern
  candidate = os.path.join(REPO_ROOT, pattern)
  return candidate if glob.glob(candidate) else pattern


def resolve_paths(patterns: str) -> str:
  return ",".join(_repo_relative(p.strip()) for p in patterns.split(",")) if patterns else patterns


def check_tokenizer(config: Config) -> None:
  """vocab_size must cover every id the tokenizer can produce."""
  if config.dataset_type != "grain":
    return
  from MaxLite.data.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
  tokenizer = load_tokenizer(resolve_paths(config.tokenizer_path))
  if config.vocab_size < tokenizer.vocab_size:
    raise ConfigError(f"vocab_size={config.vocab_size} is smaller than the tokenizer's vocabulary "
                      f"{tokenizer.vocab_size} ({config.tokenizer_path}); set vocab_size >= {tokenizer.vocab_size}")


def process_rows(sharding: NamedSharding, global_batch: int) -> tuple[int, int]:
  """[start, stop) of the global batch rows held by this process's devices (always contiguous)."""
  index_map = sharding.addressable_devices_indices_map((global_batch, 1))
  starts = [idx[0].start or 0 for idx in index_map.values()]
  stops = [global_batch if idx[0].stop is None else idx[0].stop for idx in index_map.values()]
  start, stop = min(starts), max(stops)
  covered = set()
  for a, b in zip(starts, stops):
    covered.update(range(a, b))
  if covered != set(range(start, stop)):
    raise ValueError(f"process {jax.process_index()} holds non-contiguous batch rows; reorder mesh axes")
  return start, stop


def data_shard(sharding: NamedSharding, global_batch: int) -> tuple[int, int]:
  """(shard_index, shard_count) of this process over the data-parallel split of the batch."""
  start, stop = process_rows(sharding, global_batch)
  rows = stop - start
  return start // rows, global_batch // rows


class GlobalBatchIterator:
  """Wraps a per-process numpy iterator; yields dicts of global jax.Arrays."""

  def __init__(self, local: Any, sharding: NamedSharding, global_shape: tuple[int, int], process_invariant: bool):
    self._local, self._sharding, self._global_shape = local, sharding, global_shape
    # True when the state means the same on every process (the global batch is a function of the
    # step), so a checkpoint may be resumed with a different number of processes.
    self.process_invariant = process_invariant

  def __iter__(self) -> Iterator[dict[str, jax.Array]]:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    rows = next(self._local)
    return {k: jax.make_array_from_process_local_data(self._sharding, np.asarray(rows[k]), self._global_shape)
            for k in BATCH_KEYS}

  def get_state(self) -> Any:
    return self._local.get_state()

  def set_state(self, state: Any) -> None:
    self._local.set_state(state)

  def close(self) -> None:
    close = getattr(self._local, "close", None)
    if close is not None:
      close()


def _local_iterator(config: Config, split: str, start: int, stop: int, global_batch: int) -> Any:
  if config.dataset_type == "synthetic":
    seed = config.data_shuffle_seed + (0 if split == "train" else 1_000_003)
    return SyntheticIterator(global_batch=global_batch, row_start=start, row_stop=stop,
                             seq_len=config.max_target_length, vocab_size=config.vocab_size, seed=seed)
  from MaxLite.data.grain_pipeline import make_grain_iterator  # pylint: disable=import-outside-toplevel
  files = config.grain_train_files if split == "train" else config.grain_eval_files
  rows = stop - start
  return make_grain_iterator(
      resolve_paths(files), tokenizer_path=resolve_paths(config.tokenizer_path), seq_len=config.max_target_length, batch_size=rows,
      shard_index=start // rows, shard_count=global_batch // rows, seed=config.data_shuffle_seed,
      add_bos=config.add_bos, add_eos=config.add_eos, shuffle=split == "train",
      num_epochs=None, worker_count=config.grain_worker_count)


def make_iterator(config: Config, mesh: Mesh, split: str = "train") -> GlobalBatchIterator:
  """Global batches of `global_batch_size_to_train_on` rows (all microbatches of one step)."""
  sharding = batch_sharding(mesh, config)
  global_batch = config.global_batch_size_to_train_on
  start, stop = process_rows(sharding, global_batch)
  local = _local_iterator(config, split, start, stop, global_batch)
  return GlobalBatchIterator(local, sharding, (global_batch, config.max_target_length),
                             process_invariant=config.dataset_type == "synthetic")

