"""One train.py run of a benchmark script (dpo_accuracy.py, grpo_learning.py): started from the repo root on this
machine, its output kept in a log beside the run, its metrics rows returned; a failed run stops the script with the
log's last lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(workdir: str, run_name: str, *overrides: str) -> list[dict]:
  """`python MaxLite/train.py configs/base.yml base_output_directory=WORKDIR run_name=RUN_NAME OVERRIDES...`."""
  command = [sys.executable, "MaxLite/train.py", "configs/base.yml", f"base_output_directory={workdir}"]
  command += [f"run_name={run_name}", *overrides]
  print("$", " ".join(command[1:]), flush=True)
  log = os.path.join(workdir, f"{run_name}.log")
  with open(log, "w", encoding="utf-8") as out:
    code = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode
  if code != 0:
    with open(log, encoding="utf-8") as f:
      sys.exit(f"{run_name} exited with {code}; last lines of {log}:\n" + "".join(f.readlines()[-20:]))
  with open(os.path.join(workdir, run_name, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]
