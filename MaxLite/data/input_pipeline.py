"""This process's rows of each batch -> global jax arrays sharded on the batch mesh axes.

Every input source (synthetic, grain) produces only the rows whose devices live in this process, and each
row of a global batch is a function of the data settings and the step alone (never of the process count
or mesh); `jax.make_array_from_process_local_data` stitches them into one global array per key.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from MaxLite.cli.errors import ConfigError
from MaxLite.config import Config, objectives
from MaxLite.config.post_training import data_kind
from MaxLite.data import BATCH_KEYS
from MaxLite.data.grain_pipeline import Records, make_grain_iterator
from MaxLite.data.synthetic import SyntheticIterator
from MaxLite.data.tokenizer import load_tokenizer
from MaxLite.parallel.sharding import batch_sharding
from MaxLite.storage import resolve, resolve_list


def check_tokenizer(config: Config) -> None:
  """vocab_size must cover every id the tokenizer can produce; add_bos/add_eos set explicitly without such a token is
  said once."""
  if config.dataset_type != "grain":
    return
  tokenizer = load_tokenizer(resolve(config.tokenizer_path), config.tokenizer_type)
  if config.vocab_size < tokenizer.vocab_size:
    raise ConfigError(
      f"vocab_size={config.vocab_size} is smaller than the tokenizer's vocabulary "
      f"{tokenizer.vocab_size} ({config.tokenizer_path}); set vocab_size >= {tokenizer.vocab_size}"
    )
  for key, token_id in (("add_bos", tokenizer.bos_id), ("add_eos", tokenizer.eos_id)):
    # Left at its default the key follows the tokenizer (Qwen and the shipped chat tokenizer have no BOS): nothing
    # to warn about. Set to true by the user, the documents lack what was asked for.
    if getattr(config, key) and token_id < 0 and key in config.explicit_keys:
      logging.warning("%s=true but tokenizer %s has no such token: documents get none", key, config.tokenizer_path)


def _rows_by_process(sharding: NamedSharding, global_batch: int) -> dict[int, tuple[int, ...]]:
  rows: dict[int, set[int]] = {}
  for device, index in sharding.devices_indices_map((global_batch, 1)).items():
    start, stop, _ = index[0].indices(global_batch)
    rows.setdefault(device.process_index, set()).update(range(start, stop))
  return {process: tuple(sorted(held)) for process, held in rows.items()}


def process_rows(sharding: NamedSharding, global_batch: int) -> tuple[int, ...]:
  """The global batch rows this process's devices hold, ascending. They need not be contiguous: on
  large TPU slices the mesh orders devices physically, so a host's chips can sit at rows 0-1 and 4-5.
  `make_array_from_process_local_data` takes them in this order."""
  return _rows_by_process(sharding, global_batch)[jax.process_index()]


class GlobalBatchIterator:
  """Wraps a per-process numpy iterator; yields dicts of global jax.Arrays."""

  def __init__(self, local: Any, sharding: NamedSharding, global_shape: tuple[int, int]):
    self._local, self._sharding, self._global_shape = local, sharding, global_shape
    self._start = local.get_state()

  def __iter__(self) -> Iterator[dict[str, jax.Array]]:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    rows = next(self._local)
    return {
      k: jax.make_array_from_process_local_data(self._sharding, np.asarray(rows[k]), self._global_shape)
      for k in BATCH_KEYS
    }

  def get_state(self) -> Any:
    return self._local.get_state()

  def set_state(self, state: Any) -> None:
    self._local.set_state(state)

  def rewind(self) -> None:
    """Back to the first batch (each evaluation reads the same eval batches, without reopening files)."""
    self._local.set_state(self._start)

  def close(self) -> None:
    close = getattr(self._local, "close", None)
    if close is not None:
      close()


def _local_iterator(config: Config, split: str, sharding: NamedSharding, global_batch: int) -> Any:
  rows = process_rows(sharding, global_batch)
  if config.dataset_type == "synthetic":
    seed = config.data_shuffle_seed + (0 if split == "train" else 1_000_003)
    return SyntheticIterator(
      global_batch=global_batch,
      rows=rows,
      seq_len=config.max_target_length,
      vocab_size=config.vocab_size,
      seed=seed,
      tokens=config.synthetic_tokens,
    )
  files = config.grain_train_files if split == "train" else config.grain_eval_files
  columns = config.train_data_columns if split == "train" else config.eval_data_columns or config.train_data_columns
  columns = columns or (config.grain_text_column,)
  records = None
  if objectives.of(config).reads_records:
    records = Records(
      data_kind(columns),
      columns,
      config.use_chat_template,
      resolve(config.chat_template_path) if config.chat_template_path else "",
      config.sft_train_on_completion_only,
    )
  return make_grain_iterator(
    resolve_list(files),
    tokenizer_path=resolve(config.tokenizer_path),
    seq_len=config.max_target_length,
    max_segments=config.max_segments_per_seq,
    num_slots=global_batch,
    slots=rows,
    seed=config.data_shuffle_seed,
    add_bos=config.add_bos,
    add_eos=config.add_eos,
    shuffle=split == "train",
    num_epochs=None,
    worker_count=config.grain_worker_count,
    tokenizer_type=config.tokenizer_type,
    file_type=config.grain_file_type,
    text_column=columns[0],
    records=records,
  )


def make_iterator(config: Config, mesh: Mesh, split: str = "train") -> GlobalBatchIterator:
  """Global batches of all microbatches of one step: `global_batch_size_to_load` rows for training (an ensemble with
  ensemble_data=distinct loads one batch per member), `global_batch_size_to_train_on` for eval."""
  train = split == "train"
  sharding = batch_sharding(mesh, config, loaded=train)
  global_batch = config.global_batch_size_to_load if train else config.global_batch_size_to_train_on
  local = _local_iterator(config, split, sharding, global_batch)
  return GlobalBatchIterator(local, sharding, (global_batch, config.max_target_length))
