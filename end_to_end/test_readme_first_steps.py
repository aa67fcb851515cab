"""The README's first part, run as written (end_to_end/readme.py says how): the two commands, other settings,
your own data, configuration. Also what holds for the whole README: every skip rule is used, every tool runs, every
part has its file."""

from __future__ import annotations

import os
import re

import procs
import pytest
import readme

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out

PART = "first_steps"

ran = readme.ran_fixture(PART)
test_readme_step = readme.step_test(PART)


def test_every_skip_reason_is_used_and_every_tool_runs():
  """A skip rule nothing matches is stale; and each tool the README shows runs at least once: here, or (the pod-scale
  compiles) in the test files the skip reason of its lines names, which start the tool themselves."""
  commands = [step for step in readme.STEPS if step.kind == "bash"]
  unused = [pattern for pattern, _ in readme.SKIPPED if not any(re.search(pattern, c.body) for c in commands)]
  assert not unused, f"skip rules that match no README line: {unused}"
  run = " ".join(c.body for c in commands if not readme.skip_reason(c))
  for tool in ("train.py", "decode.py", "convert_hf.py", "train_compile.py", "plan.py", "launch_local.py"):
    if f"MaxLite/{tool}" in run:
      continue
    reasons = {readme.skip_reason(c) for c in commands if f"MaxLite/{tool}" in c.body}
    named = {name for reason in reasons for name in re.findall(r"tests/[\w/]+\.py", reason)}
    starting = [name for name in named if f"MaxLite/{tool}" in _text(name) or f'"MaxLite", "{tool}"' in _text(name)]
    assert starting, f"no README line runs {tool}, and no test its skip reasons name starts it: {sorted(named)}"
  assert any(step.kind == "python" for step in readme.STEPS)


def _text(relative: str) -> str:
  with open(os.path.join(procs.REPO, relative), encoding="utf-8") as f:
    return f.read()


def test_every_part_runs_in_its_own_file_and_every_step_in_one_part():
  here = os.path.dirname(os.path.abspath(__file__))
  for part, _ in readme.PARTS:
    with open(os.path.join(here, f"test_readme_{part}.py"), encoding="utf-8") as f:
      assert f'\nPART = "{part}"\n' in f.read(), part
  assert [step for part, _ in readme.PARTS for step in readme.steps_of(part)] == readme.STEPS


def test_the_first_run_logs_every_step_to_metrics_and_tensorboard(ran):
  """The first command as written (configs/base.yml as shipped: grain over assets/corpus, sentencepiece): every step's
  row holds what the README's metrics table lists, tensorboard reads the same losses, the start-up summary prints the
  derived values. That it learns: .ci/run runs it for its 200 steps and checks the loss falls."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  rows = readme.metric_rows(ran, "first")
  steps = [r for r in rows if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2]  # the cap's steps=2
  for key in ("loss", "learning_rate", "grad_norm", "step_time_s", "tokens_per_s", "tflops_per_device"):
    assert all(key in r for r in steps), key
  assert [r["step"] for r in rows if "eval_loss" in r] == [2]  # the last step evaluates
  accumulator = EventAccumulator(os.path.join(ran["checkout"], "outputs", "first", "tensorboard"))
  accumulator.Reload()
  losses = accumulator.Scalars("learning/loss")
  assert [e.step for e in losses] == [1, 2]
  assert abs(losses[-1].value - steps[-1]["loss"]) < 1e-5
  printed = readme.output(ran, r"^L\d+ python train\.py run_name=first$")
  assert "global_batch_size_to_train_on = 4" in printed and "num_params" in printed
