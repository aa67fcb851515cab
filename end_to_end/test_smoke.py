"""Smoke: the tiny model trains on the shipped data, deterministically, to the recorded golden losses.

The golden file holds the per-step losses of GOLDEN_ARGS on one CPU device. Two runs on this machine
must agree bit for bit; against the golden file the losses must agree to GOLDEN_RTOL, because XLA's CPU
code differs in the last float32 bits between processor models (seen: AMD EPYC vs the machine that
wrote the file, 1e-7 relative). After a change that is meant to alter the numbers, regenerate the
file (that run writes it and fails, so it is never mistaken for a pass), then review the diff:

  UPDATE_GOLDEN=1 python3 -m pytest -q end_to_end/test_smoke.py
"""

import json
import os

import procs
import pytest

# Relative tolerance against the golden file: last-bit rounding of another CPU, not a changed model.
GOLDEN_RTOL = 1e-5
GOLDEN_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "tiny_losses.json")
GOLDEN_ARGS = (
  "model_name=tiny",
  "dataset_type=grain",
  "max_target_length=128",
  "per_device_batch_size=4",
  "steps=12",
  "learning_rate=1e-2",
  "learning_rate_schedule_steps=12",
  "eval_interval=-1",
  "log_period=1",
  "enable_tensorboard=false",
)


def _train(tmp_path, run_name):
  log = str(tmp_path / f"{run_name}.log")
  code = procs.run(procs.train_command(*GOLDEN_ARGS, f"base_output_directory={tmp_path}", f"run_name={run_name}"), log)
  assert code == 0, procs.tail(log)
  return procs.losses(procs.metric_rows(str(tmp_path / run_name / "metrics.jsonl")))


def test_tiny_model_trains_deterministically_to_the_golden_losses(tmp_path):
  first, second = _train(tmp_path, "a"), _train(tmp_path, "b")
  assert first == second  # same config + seed: bit for bit
  # Checkpoints are on by default (MaxText's default), and the run says where they go.
  assert os.listdir(tmp_path / "a" / "checkpoints") == ["12"]
  with open(tmp_path / "a.log", encoding="utf-8") as f:
    assert f"checkpoints: every 100 steps, the last step and on SIGTERM, to {tmp_path}/a/checkpoints" in f.read()
  steps = sorted(first)
  assert steps == list(range(1, 13))
  assert sum(first[s] for s in steps[-3:]) / 3 < sum(first[s] for s in steps[:3]) / 3 - 1.0  # it learns
  if os.environ.get("UPDATE_GOLDEN"):
    with open(GOLDEN_FILE, "w", encoding="utf-8") as f:
      json.dump({"args": list(GOLDEN_ARGS), "devices": 1, "losses": {str(s): first[s] for s in steps}}, f, indent=2)
      f.write("\n")
    pytest.fail(f"wrote {GOLDEN_FILE}; review its diff, then run again without UPDATE_GOLDEN")
  with open(GOLDEN_FILE, encoding="utf-8") as f:
    golden = json.load(f)
  assert golden["args"] == list(GOLDEN_ARGS), "GOLDEN_ARGS changed: regenerate the golden file (see module doc)"
  expected = {int(s): v for s, v in golden["losses"].items()}
  assert sorted(expected) == steps
  worst = max(abs(first[s] - expected[s]) / abs(expected[s]) for s in steps)
  print(f"largest relative difference from the golden losses: {worst:.2e}")
  assert worst <= GOLDEN_RTOL, (
    f"losses differ from end_to_end/golden/tiny_losses.json by up to {worst:.2e} (allowed {GOLDEN_RTOL:.0e}); "
    "if the change is intended, regenerate it (see module doc)"
  )
