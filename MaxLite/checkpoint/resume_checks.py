"""What a run may not change when it resumes from its own checkpoint.

An exact resume continues the same model on the same data stream. The stream is a function of the data
files, tokenizer, chat template, seed, sequence length, global batch size and packing settings (MaxLite/data/
grain_pipeline.py; the data position also records the tokenizer's and template's contents),
and the weights only fit the same model shape; the mesh, the number of processes, `steps` and everything
else may change. A difference is named, never absorbed: silently continuing would skip or repeat data.

A step without its saved config (saved before configs were stored, or the file was lost) has nothing to compare: it
is resumed, with a warning naming the keys left unchecked. Stopping would leave such a run no step to resume from,
and the weights are still checked against this model's shapes when they are read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from absl import logging

from MaxLite import storage
from MaxLite.checkpoint import saved_config_path
from MaxLite.cli.errors import CheckpointError
from MaxLite.config import MODEL_KEYS, Config

# Keys that define the data stream, for any dataset_type (ensemble_data=distinct reads a batch per member).
STREAM_KEYS = (
  "dataset_type",
  "data_shuffle_seed",
  "max_target_length",
  "global_batch_size_to_train_on",
  "ensemble_data",
)
# Keys that define the stream of synthetic data only.
SYNTHETIC_STREAM_KEYS = ("synthetic_tokens",)
# Keys that define the stream of real data only (synthetic data ignores them).
FILE_STREAM_KEYS = (
  "grain_train_files",
  "grain_file_type",
  "grain_text_column",
  "max_segments_per_seq",
  "tokenizer_path",
  "tokenizer_type",
  "add_bos",
  "add_eos",
  "objective",
  "sft_train_on_completion_only",
  "train_data_columns",
  "use_chat_template",
  "chat_template_path",
)


def resume_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
  """`key saved -> current` for each stream or model key that differs (keys the saved config lacks are skipped)."""
  keys = list(STREAM_KEYS) + list(MODEL_KEYS) + ["ensemble_size"]
  if current.get("dataset_type") != "synthetic" or saved.get("dataset_type") != "synthetic":
    keys += FILE_STREAM_KEYS
  else:
    keys += SYNTHETIC_STREAM_KEYS
  return [
    f"{key} {saved[key]!r} -> {current.get(key)!r}" for key in keys if key in saved and saved[key] != current.get(key)
  ]


def check_resume(step_dir: str, config: Config) -> None:
  """CheckpointError naming every difference between the step's saved config and this one; a warning if the step
  has no saved config."""
  path = saved_config_path(step_dir)
  if not storage.isfile(path):
    keys = STREAM_KEYS + (FILE_STREAM_KEYS if config.dataset_type != "synthetic" else SYNTHETIC_STREAM_KEYS)
    logging.warning(
      "checkpoint %s has no saved config (%s): resuming it with %s not checked against the values it was saved with "
      "(a change skips or repeats data; then stop and start a new run_name with load_full_state_path=%s)",
      step_dir,
      path,
      ", ".join(keys),
      step_dir,
    )
    return
  saved = json.loads(storage.read_text(path))
  current = config.to_dict()  # lists for tuples, as JSON has
  differences = resume_differences(saved, current)
  model = [key for key in MODEL_KEYS if key in saved and saved[key] != current.get(key)]
  if model:  # load_full_state_path reads the same shapes, so it is no way out here
    raise CheckpointError(
      f"checkpoint {step_dir} cannot be resumed exactly: {'; '.join(differences)}. Drop {', '.join(model)} from the "
      f"command line and config file (a resumed run takes its model from the checkpoint: model_name="
      f"{saved.get('model_name', 'default')}), or start a new run_name"
    )
  if "ensemble_size" in saved and saved["ensemble_size"] != current.get("ensemble_size"):  # the state's shape
    raise CheckpointError(
      f"checkpoint {step_dir} holds {saved['ensemble_size']} ensemble members, not ensemble_size="
      f"{current.get('ensemble_size')}: go back to ensemble_size={saved['ensemble_size']}, or start a new run_name "
      "(load_parameters_path with ensemble_member=i starts from one member)"
    )
  if differences:
    raise CheckpointError(
      f"checkpoint {step_dir} cannot be resumed exactly: {'; '.join(differences)}. Go back to the saved values, "
      f"or start a new run_name with load_full_state_path={step_dir} (same weights and optimizer, a new data stream)"
    )
