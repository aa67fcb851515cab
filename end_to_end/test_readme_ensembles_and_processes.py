"""The README's ensembles, Flax NNX and several-processes parts, run as written (end_to_end/readme.py says
how): the learning-rate sweep names its best member and a run of that member starts from its trained weights."""

from __future__ import annotations

import re

import pytest
import readme

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out

PART = "ensembles_and_processes"

ran = readme.ran_fixture(PART)
test_readme_step = readme.step_test(PART)


def test_sweep_names_its_best_member(ran):
  """By the last eval's losses, or (no eval within the cap's steps) by the last step's training losses."""
  printed = readme.output(ran, r"train\.py run_name=lr-sweep")
  best = re.search(r"best member (\d) \((eval loss|loss) ([\d.]+), learning rate ([\d.e-]+)\)", printed)
  assert best, printed[-2000:]
  rows = readme.metric_rows(ran, "lr-sweep")
  key = "eval_loss" if best[2] == "eval loss" else "loss"
  last = [r for r in rows if f"{key}/member_0" in r][-1]
  losses = [last[f"{key}/member_{i}"] for i in range(4)]
  assert int(best[1]) == losses.index(min(losses)) and float(best[3]) == round(min(losses), 4)
  # The member run starts from the sweep's trained member 2, not a fresh model.
  assert readme.metric_rows(ran, "lr-best")[0]["loss"] < rows[0]["loss/member_2"]
