"""What a checkpoint directory holds, read from metadata only (no arrays are loaded)."""

from __future__ import annotations

import json

import numpy as np

from MaxLite import storage
from MaxLite.checkpoint import DATA_ITER, STATE, saved_config_path
from MaxLite.checkpoint import manager as checkpointing
from MaxLite.cli.errors import CheckpointError

_CONFIG_SHOWN = (
  "model_name",
  "num_params",
  "scan_layers",
  "weight_dtype",
  "mesh_shape",
  "process_count",
  "global_batch_size_to_train_on",
  "max_target_length",
  "dataset_type",
  "steps",
  "tokenizer_type",  # the tokenizer decode.py and to_hf take from the checkpoint
  "tokenizer_path",
)


def find_steps(path: str) -> tuple[str, list[int], list[str]]:
  """(checkpoints dir, complete steps ascending, names of incomplete saves)."""
  path = storage.absolute(path).rstrip("/")
  if not storage.isdir(path):
    raise CheckpointError(f"{path}: no such directory")
  if storage.isdir(storage.join(path, "checkpoints")):
    path = storage.join(path, "checkpoints")
  return path, checkpointing.step_numbers(path), checkpointing.incomplete_saves(path)


def _bytes(n: int) -> str:
  return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n:,} B"


def describe_step(step_dir: str) -> list[str]:
  arrays = checkpointing.saved_arrays(checkpointing.resolve_state_dir(step_dir, "checkpoint"))
  lines = []
  config_file = saved_config_path(step_dir)
  if storage.exists(config_file):
    config = json.loads(storage.read_text(config_file))
    lines.append("  config: " + ", ".join(f"{k}={config[k]}" for k in _CONFIG_SHOWN if k in config))
  totals: dict[str, list[int]] = {}
  rows = []
  for name, meta in sorted(arrays.items()):
    count = int(np.prod(meta.shape, dtype=np.int64))
    size = count * np.dtype(meta.dtype).itemsize
    group = name.split(".")[0]
    totals.setdefault(group, [0, 0])
    totals[group][0] += count
    totals[group][1] += size
    if group == "params":
      rows.append(
        f"    {name[len('params.') :]:<52} {str(tuple(meta.shape)):<18} {np.dtype(meta.dtype).name:<9} {_bytes(size)}"
      )
  for group, (count, size) in sorted(totals.items()):
    lines.append(f"  {group}: {count:,} values, {_bytes(size)}")
  lines.append(f"  total: {_bytes(sum(size for _, size in totals.values()))}")
  lines.append("  parameters:")
  lines += rows
  data_dir = storage.join(step_dir, DATA_ITER)
  if storage.isdir(data_dir):
    files = sorted(n for n in storage.listdir(data_dir) if n.startswith("process_"))
    lines.append(f"  data iterator: {', '.join(files)}")
  return lines


def describe(path: str, step: int | None = None) -> str:
  if storage.isdir(storage.join(path, STATE)):  # a single step directory
    return "\n".join([f"checkpoint {storage.absolute(path)}", *describe_step(path)])
  root, steps, partial = find_steps(path)
  if not steps:
    raise CheckpointError(
      f"{root} holds no complete checkpoint" + (f" (incomplete: {', '.join(partial)})" if partial else "")
    )
  if step is not None and step not in steps:
    raise CheckpointError(f"step {step} is not in {root}; complete steps: {', '.join(map(str, steps))}")
  chosen = steps[-1] if step is None else step
  lines = [f"{root}: steps {', '.join(map(str, steps))}"]
  if partial:
    lines.append(f"incomplete saves (ignored on resume): {', '.join(partial)}")
  lines.append(f"step {chosen}:")
  lines += describe_step(storage.join(root, str(chosen)))
  return "\n".join(lines)
