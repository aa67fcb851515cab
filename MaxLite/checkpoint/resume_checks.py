"""What a run may not change when it resumes from its own checkpoint.

An exact resume continues the same model on the same data stream. The stream is a function of the data
files, tokenizer, chat template, seed, sequence length, global batch size and packing settings (MaxLite/data/
grain_pipeline.py; the data position also records the tokenizer's and template's contents),
and the weights only fit the same model shape; the mesh, the number of processes, `steps` and everything
else may change. A difference is named, never absorbed: silently continuing would skip or repeat data.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from MaxLite import storage
from MaxLite.checkpoint import saved_config_path
from MaxLite.cli.errors import CheckpointError
from MaxLite.config import MODEL_KEYS, Config

# Keys that define the data stream, for any dataset_type.
STREAM_KEYS = ("dataset_type", "data_shuffle_seed", "max_target_length", "global_batch_size_to_train_on")
# Keys that define the stream of real data only (synthetic data ignores them).
FILE_STREAM_KEYS = (
  "grain_train_files",
  "grain_file_type",
  "grain_text_column",
  "tokenizer_path",
  "tokenizer_type",
  "add_bos",
  "add_eos",
  "use_sft",
  "use_dpo",
  "sft_train_on_completion_only",
  "train_data_columns",
  "use_chat_template",
  "chat_template_path",
)


def resume_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
  """`key saved -> current` for each stream or model key that differs (keys the saved config lacks are skipped)."""
  keys = list(STREAM_KEYS) + list(MODEL_KEYS)
  if current.get("dataset_type") != "synthetic" or saved.get("dataset_type") != "synthetic":
    keys += FILE_STREAM_KEYS
  return [
    f"{key} {saved[key]!r} -> {current.get(key)!r}" for key in keys if key in saved and saved[key] != current.get(key)
  ]


def check_resume(step_dir: str, config: Config) -> None:
  """CheckpointError naming every difference between the step's saved config and this one."""
  path = saved_config_path(step_dir)
  if not storage.isfile(path):
    return  # saved before configs were stored: nothing to compare
  saved = json.loads(storage.read_text(path))
  differences = resume_differences(saved, config.to_dict())  # to_dict gives lists for tuples, as JSON does
  if differences:
    raise CheckpointError(
      f"checkpoint {step_dir} cannot be resumed exactly: {'; '.join(differences)}. Go back to the saved values, "
      f"or start a new run_name with load_full_state_path={step_dir} (same weights and optimizer, a new data stream)"
    )
