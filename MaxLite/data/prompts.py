"""GRPO's prompts: records of train_data_columns read in a deterministic order, a batch of them per step.

The first column is the prompt; the others (a reference answer, test cases) travel with it to the reward functions.
Training reads the records shuffled (data_shuffle_seed), epoch after epoch, each epoch its own order; evaluation
reads them in file order from the start every time. Every process reads the whole batch: the rewards of a group need
all of its completions, and the batch is small (prompts, not tokens). The position in the stream is the number of
records read, which is what a checkpoint stores (get_state / set_state), so a resumed run reads on exactly where the
saved one stopped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from MaxLite.cli.errors import InputError
from MaxLite.config import Config
from MaxLite.data.sources import open_records
from MaxLite.storage import resolve_list


class PromptRecords:
  """Batches of `count` records (dicts of the columns) from the train or eval files."""

  def __init__(self, config: Config, split: str, count: int):
    files = config.grain_train_files if split == "train" else config.grain_eval_files
    self._columns = tuple(config.train_data_columns if split == "train" else config.eval_data_columns)
    self._what = "grain_train_files" if split == "train" else "grain_eval_files"
    self._source = open_records(resolve_list(files), config.grain_file_type, self._columns)
    self._count, self._shuffle, self._seed = count, split == "train", config.data_shuffle_seed
    if len(self._source) == 0:
      raise InputError(f"{self._what}: no records in {files!r}")
    self._read = 0
    self._orders: dict[int, np.ndarray] = {}

  @property
  def prompt_column(self) -> str:
    return self._columns[0]

  def _index(self, position: int) -> int:
    epoch, offset = divmod(position, len(self._source))
    if not self._shuffle:
      return offset
    if epoch not in self._orders:
      self._orders = {epoch: np.random.default_rng([self._seed, epoch]).permutation(len(self._source))}
    return int(self._orders[epoch][offset])

  def __iter__(self) -> PromptRecords:
    return self

  def __next__(self) -> list[dict[str, Any]]:
    indices = [self._index(self._read + i) for i in range(self._count)]
    self._read += self._count
    records = []
    for index in indices:
      record = self._source[index]
      if not isinstance(record[self.prompt_column], str):
        raise InputError(
          f"{self._what}: record {index} field {self.prompt_column!r} (the prompt, train_data_columns[0]) must be "
          f"a string, got {type(record[self.prompt_column]).__name__}"
        )
      records.append(dict(record, _index=index))
    return records

  def get_state(self) -> dict[str, int]:
    return {"records_read": self._read}

  def set_state(self, state: dict[str, Any]) -> None:
    self._read = int(state["records_read"])

  def rewind(self) -> None:
    self._read = 0

  def close(self) -> None:
    pass
