"""Run train.py / launch_local.py as real processes, kill them, read their metrics (test helpers)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

from MaxLite.launch.local import process_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_YML = os.path.join(REPO, "configs", "base.yml")

TRAIN = os.path.join(REPO, "MaxLite", "train.py")
# The tiny model on 64-token rows, learning fast and logging every step: what the end-to-end runs compare.
TINY = (
  "model_name=tiny",
  "max_target_length=64",
  "learning_rate=1e-2",
  "learning_rate_schedule_steps=16",
  "eval_interval=-1",
  "log_period=1",
)
LAUNCH = os.path.join(REPO, "MaxLite", "launch_local.py")


def env_with_devices(n: int) -> dict[str, str]:
  # launch_local's environment: n CPU devices, and the other XLA flags kept (tests/support/fast_compile.py's
  # FAST_COMPILE: these processes compile as the tests do).
  return process_env(n)


def train_command(*overrides: str) -> list[str]:
  return [sys.executable, TRAIN, BASE_YML, *overrides]


def launch_command(num_processes: int, devices: int, *overrides: str) -> list[str]:
  """launch_local.py with every process's lines in its output (the tests read what each process said)."""
  return [
    sys.executable,
    LAUNCH,
    f"--num_processes={num_processes}",
    f"--devices_per_process={devices}",
    "--show_all_processes",
    BASE_YML,
    *overrides,
  ]


def start(command: list[str], log_path: str, devices: int = 1) -> subprocess.Popen:
  """Own session, so the test can kill the process and all its children at once."""
  log = open(log_path, "ab")
  return subprocess.Popen(
    command, env=env_with_devices(devices), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
  )


def run(command: list[str], log_path: str, devices: int = 1, timeout: float = 300) -> int:
  proc = start(command, log_path, devices)
  try:
    return proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    kill_group(proc)
    raise


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
  try:
    os.killpg(proc.pid, sig)
  except ProcessLookupError:
    pass
  proc.wait(timeout=60)


def metric_rows(metrics_file: str, offset: int = 0) -> list[dict]:
  if not os.path.exists(metrics_file):
    return []
  with open(metrics_file, encoding="utf-8") as f:
    f.seek(offset)
    return [json.loads(line) for line in f if line.endswith("\n")]


def resumed_rows(metrics_file: str, log_path: str) -> list[dict]:
  """The rows a resumed run wrote: those after the step its log says it resumed from (the last such line). A resume
  drops the rows the stopped run wrote after that step, so the file must hold each step's row once, in order."""
  with open(log_path, encoding="utf-8", errors="replace") as f:
    restored = re.findall(r"resumed (?:the adapters )?from checkpoint at step (\d+)", f.read())
  assert restored, f"{log_path}: the run did not resume from a checkpoint"
  rows = metric_rows(metrics_file)
  steps = [r["step"] for r in rows if "loss" in r]
  assert steps == sorted(set(steps)), f"{metrics_file}: a step logged twice or out of order: {steps}"
  return [r for r in rows if r["step"] > int(restored[-1])]


def losses(rows: list[dict]) -> dict[int, float]:
  """{step: loss} of the training rows (a step in the rows twice keeps its last value)."""
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def wait_for_step(proc: subprocess.Popen, metrics_file: str, step: int, log_path: str, timeout: float = 300) -> None:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if any(s >= step for s in losses(metric_rows(metrics_file))):
      return
    if proc.poll() is not None:
      raise AssertionError(f"process exited with {proc.returncode} before step {step}:\n{tail(log_path)}")
    time.sleep(0.05)
  kill_group(proc)
  raise AssertionError(f"step {step} not reached within {timeout}s:\n{tail(log_path)}")


def wait_for_saved_step(proc: subprocess.Popen, step_dir: str, timeout: float = 120) -> None:
  """Until `step_dir` is complete on disk (a local step exists only once orbax has renamed it into place): on a
  loaded machine an async save can still be writing when a later step is logged, and a kill then leaves no step to
  resume from."""
  deadline = time.monotonic() + timeout
  while not os.path.isdir(step_dir) and proc.poll() is None and time.monotonic() < deadline:
    time.sleep(0.05)


def killed_and_run_again(
  command: list[str], run_dir: str, log_path: str, kill_after: int, checkpoint_period: int, devices: int = 1
) -> tuple[list[dict], list[dict]]:
  """Start `command`, SIGKILL it once step `kill_after` is logged and the checkpoint before it is on disk, run the
  same command to the end: (the rows the killed run wrote, uninterrupted up to the kill; the rows the rerun wrote,
  `resumed_rows`). The rerun replays the steps after its checkpoint, so those rows are their own bit-for-bit
  reference. The killed rows are read before the rerun, which drops the rows after its checkpoint."""
  metrics = os.path.join(run_dir, "metrics.jsonl")
  proc = start(command, log_path, devices)
  wait_for_step(proc, metrics, kill_after, log_path)
  wait_for_saved_step(
    proc, os.path.join(run_dir, "checkpoints", str(kill_after // checkpoint_period * checkpoint_period))
  )
  kill_group(proc, signal.SIGKILL)
  before = metric_rows(metrics)
  assert run(command, log_path, devices) == 0, tail(log_path)
  return before, resumed_rows(metrics, log_path)


def tail(path: str, lines: int = 30) -> str:
  with open(path, encoding="utf-8", errors="replace") as f:
    return "".join(f.readlines()[-lines:])
