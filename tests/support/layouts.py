"""The tiny training runs that the layout tests compare with one device: a few steps on synthetic data, no
checkpoints, each step's loss and gradient norm (tests/parallel/test_parallelism.py and each family's and feature's
own layout tests)."""

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


def loss_curves(rows):
  return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]
