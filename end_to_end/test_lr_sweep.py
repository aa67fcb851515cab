"""README's "Sweep a learning rate", command for command: four members in one run (one TensorBoard series each), the
closing line names the best member, decode.py reads that member, and a run of that member alone starts from its
weights."""

import json
import re

import pytest
from procs import output_of, readme_commands

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out


def test_readme_sweep_pick_decode_continue(tmp_path):
  """The README's three commands as written, with (appended, later keys win) a laptop's few steps of the tiny model;
  the member the closing line names replaces the README's example member and rate."""
  laptop = ["model_name=tiny", "max_target_length=64", "per_device_batch_size=2", f"base_output_directory={tmp_path}"]
  sweep, decode, alone = readme_commands("### Sweep a learning rate")
  assert [c[1] for c in (sweep, decode, alone)] == ["MaxLite/train.py", "MaxLite/decode.py", "MaxLite/train.py"]

  printed = output_of([*sweep[1:], *laptop, "steps=4", "eval_interval=2", "eval_steps=1", "checkpoint_period=4"])
  done = re.search(r"best member (\d) \(eval loss ([\d.]+), learning rate ([\d.e-]+)\)", printed)
  assert done, printed
  best, best_loss, best_rate = int(done[1]), float(done[2]), done[3]
  with open(tmp_path / "lr-sweep" / "metrics.jsonl") as f:
    last_eval = [row for row in map(json.loads, f) if "eval_loss/member_0" in row][-1]
  losses = [last_eval[f"eval_loss/member_{i}"] for i in range(4)]
  assert best == losses.index(min(losses)) and best_loss == pytest.approx(min(losses), abs=1e-4)

  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  events = EventAccumulator(str(tmp_path / "lr-sweep" / "tensorboard"))
  events.Reload()
  for i in range(4):
    assert [e.step for e in events.Scalars(f"learning/loss/member_{i}")] == [1, 2, 3, 4]
  assert [e.step for e in events.Scalars("eval/eval_ensemble_loss")] == [2, 4]

  def chosen(args):  # the README's example member, rate and paths -> this sweep's
    args = [re.sub(r"^ensemble_member=\d+$", f"ensemble_member={best}", a) for a in args]
    args = [re.sub(r"^learning_rate=.*$", f"learning_rate={best_rate}", a) for a in args]
    return [
      a.replace("outputs/lr-sweep/checkpoints/200", str(tmp_path / "lr-sweep" / "checkpoints" / "4")) for a in args
    ]

  text = output_of(
    [
      *chosen(decode[1:]),
      "model_name=tiny",
      "max_target_length=64",
      "max_prefill_predict_length=16",
      "max_decode_steps=4",
    ]
  )
  assert re.search(r"^\[0\] ", text, re.M), text
  continued = output_of([*chosen(alone[1:]), *laptop, "steps=2", "eval_interval=-1"])
  assert "done: step 2" in continued
  with open(tmp_path / "lr-best" / "metrics.jsonl") as f:
    first = json.loads(f.readline())
  # Started from the sweep's trained member, not a fresh model: its first loss is below the sweep's first.
  with open(tmp_path / "lr-sweep" / "metrics.jsonl") as f:
    sweep_first = json.loads(f.readline())
  assert first["loss"] < sweep_first[f"loss/member_{best}"] - 0.1
