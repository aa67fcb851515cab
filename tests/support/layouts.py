"""The tiny training runs that the layout tests compare with one device: a few steps on synthetic data, no
checkpoints, each step's loss and gradient norm (tests/parallel/test_parallelism.py, tests/parallel/
test_feature_layouts.py and each family's own layout tests). cached_rows keeps a reference run per test process."""

import functools
import tempfile
import types

from MaxLite.training.trainer import train
from support.config import first_devices, make_config

RUN = (
  "max_target_length=64",
  "steps=3",
  "dataset_type=synthetic",
  "eval_interval=-1",  # the last step's eval: not what these tests compare
  "enable_tensorboard=false",
  "learning_rate=1e-2",
  "warmup_steps_fraction=0.0",
  "enable_checkpointing=false",  # nothing here reads a checkpoint; a save costs seconds of orbax compiles
)
# The tiny model with 8 query and 8 kv heads, so that tensor=8 can split them.
DENSE = ("model_name=tiny", "base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=8")


def train_layout(tmp_path, num_devices, *overrides):
  config = make_config(*RUN, f"base_output_directory={tmp_path}", "run_name=run", *overrides, num_devices=num_devices)
  rows = train(config, first_devices(num_devices))
  return rows


@functools.cache
def cached_rows(num_devices, *overrides):
  """train_layout's rows for these overrides, run once per test process (each xdist worker) and then shared by every
  test and file that asks for the same overrides in the same order: the reference runs (one device; a layout without
  a feature) that several tests compare with. Read-only: a tuple of read-only mappings."""
  with tempfile.TemporaryDirectory() as tmp:  # nothing reads the run's directory after it (no checkpoints)
    rows = train_layout(tmp, num_devices, *overrides)
  return tuple(types.MappingProxyType(dict(row)) for row in rows)


def loss_curves(rows):
  return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]
