"""Resume checks by replay: a run that saves a checkpoint halfway, with its last checkpoint removed, is the state a
kill after its last step (before that step's save) leaves. Run again with the same config, it resumes from the
checkpoint before and runs the steps after it again; those must equal the first run's, bit for bit."""

import os
import shutil

from MaxLite.training.trainer import train
from support.config import first_devices


def rerun_from_the_checkpoint_before_the_last(config, num_devices: int = 1) -> list[dict]:
  """Removes the last step's checkpoint of `config`'s finished run and trains it again on `num_devices`; asserts the
  rerun resumed at the checkpoint before (checkpoint_period) and returns its rows."""
  run_dir = os.path.join(config.base_output_directory, config.run_name)
  shutil.rmtree(os.path.join(run_dir, "checkpoints", str(config.steps)))
  rows = train(config, first_devices(num_devices))
  before = (config.steps - 1) // config.checkpoint_period * config.checkpoint_period
  steps = sorted({r["step"] for r in rows if "loss" in r})
  assert steps == list(range(before + 1, config.steps + 1)), steps
  return rows
