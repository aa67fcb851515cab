"""What a checkpoint directory holds, read from metadata only (no arrays are loaded).

  python MaxLite/checkpoint_info.py outputs/<run>/checkpoints [--step N]

PATH may be a run directory, its checkpoints/ directory or one step directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=wrong-import-position

from MaxLite import checkpointing  # pylint: disable=wrong-import-position
from MaxLite.errors import CheckpointError, MaxLiteError  # pylint: disable=wrong-import-position

_CONFIG_SHOWN = ("model_name", "num_params", "scan_layers", "weight_dtype", "mesh_shape", "process_count",
                 "global_batch_size_to_train_on", "max_target_length", "dataset_type", "steps")


def find_steps(path: str) -> tuple[str, list[int], list[str]]:
  """(checkpoints dir, complete steps ascending, names of incomplete saves)."""
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: no such directory")
  if os.path.isdir(os.path.join(path, "checkpoints")):
    path = os.path.join(path, "checkpoints")
  return path, checkpointing.step_numbers(path), sorted(n for n in os.listdir(path) if "tmp" in n)


def _bytes(n: int) -> str:
  return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n:,} B"


def describe_step(step_dir: str) -> list[str]:
  arrays = checkpointing.saved_arrays(checkpointing.resolve_state_dir(step_dir, "checkpoint"))
  lines = []
  config_file = os.path.join(step_dir, checkpointing.CONFIG, checkpointing.CONFIG_FILE)
  if os.path.exists(config_file):
    with open(config_file, encoding="utf-8") as f:
      config = json.load(f)
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
      rows.append(f"    {name[len('params.'):]:<52} {str(tuple(meta.shape)):<18} {np.dtype(meta.dtype).name:<9} "
                  f"{_bytes(size)}")
  for group, (count, size) in sorted(totals.items()):
    lines.append(f"  {group}: {count:,} values, {_bytes(size)}")
  lines.append(f"  total: {_bytes(sum(size for _, size in totals.values()))}")
  lines.append("  parameters:")
  lines += rows
  data_dir = os.path.join(step_dir, checkpointing.DATA_ITER)
  if os.path.isdir(data_dir):
    files = sorted(n for n in os.listdir(data_dir) if n.startswith("process_"))
    lines.append(f"  data iterator: {', '.join(files)}")
  return lines


def describe(path: str, step: int | None = None) -> str:
  if os.path.isdir(os.path.join(path, checkpointing.STATE)):  # a single step directory
    return "\n".join([f"checkpoint {os.path.abspath(path)}", *describe_step(path)])
  root, steps, partial = find_steps(path)
  if not steps:
    raise CheckpointError(f"{root} holds no complete checkpoint" + (f" (incomplete: {', '.join(partial)})"
                                                                     if partial else ""))
  if step is not None and step not in steps:
    raise CheckpointError(f"step {step} is not in {root}; complete steps: {', '.join(map(str, steps))}")
  chosen = steps[-1] if step is None else step
  lines = [f"{root}: steps {', '.join(map(str, steps))}"]
  if partial:
    lines.append(f"incomplete saves (ignored on resume): {', '.join(partial)}")
  lines.append(f"step {chosen}:")
  lines += describe_step(os.path.join(root, str(chosen)))
  return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("path")
  parser.add_argument("--step", type=int, default=None, help="default: the latest complete step")
  args = parser.parse_args(argv)
  try:
    print(describe(args.path, args.step))
  except MaxLiteError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
