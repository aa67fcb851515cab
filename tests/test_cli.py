"""The documented command, end to end: exit 0, loss falls, metrics.jsonl rows, readable tensorboard events."""

import glob
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, run_train_cli

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out


def test_train_command_synthetic_20_steps(tmp_path):
  proc = run_train_cli("dataset_type=synthetic", "steps=20", f"base_output_directory={tmp_path}", "run_name=smoke")
  assert proc.returncode == 0, proc.stderr[-3000:]
  run_dir = tmp_path / "smoke"
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, 21))
  for key in ("loss", "learning_rate", "grad_norm", "step_time_s", "tokens_per_s", "tflops_per_device"):
    assert all(key in r for r in rows), key
  first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
  print(f"loss first 3 steps {first:.3f}, last 3 steps {last:.3f}")
  assert last < first - 0.5

  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  events = glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))
  assert events
  accumulator = EventAccumulator(str(run_dir / "tensorboard"))
  accumulator.Reload()
  losses = accumulator.Scalars("learning/loss")
  assert [e.step for e in losses] == list(range(1, 21))
  assert abs(losses[-1].value - rows[-1]["loss"]) < 1e-5
  # The start-up summary prints the derived values.
  assert "global_batch_size_to_train_on = 4" in proc.stderr and "num_params" in proc.stderr


def test_default_command_learns_the_shipped_corpus(tmp_path):
  """configs/base.yml as shipped (grain over assets/corpus, sentencepiece), run from another directory."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  cmd = [
    sys.executable,
    os.path.join(REPO, "MaxLite", "train.py"),
    os.path.join(REPO, "configs", "base.yml"),
    "steps=50",
    "eval_interval=50",
    "eval_steps=5",
    f"base_output_directory={tmp_path}",
    "run_name=default",
  ]
  proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
  first_loss = rows[0]["loss"]
  eval_loss = [r["eval_loss"] for r in rows if "eval_loss" in r]
  print(f"loss at step 1: {first_loss:.3f}; eval loss after step 50: {eval_loss}")
  assert len(eval_loss) == 1 and eval_loss[0] < first_loss - 2.0
