"""Emergency checkpoints resumed by 2 real processes (jax.distributed, gloo) when only process 1 cannot read the
newest step: the processes agree on what to do before orbax's collective restore, which a process left alone in it
would wait in for good. Each process is one data replica on one CPU device (orbax's emergency manager needs 2)."""

import os
import re
import shutil
import subprocess
import time

import procs
import pytest

from MaxLite.checkpoint.reads import FAULT_ENV
from MaxLite.launch.local import free_port, process_command

pytestmark = pytest.mark.slow  # three 2-process runs

ARGS = (
  *procs.TINY,
  "enable_tensorboard=false",
  "dataset_type=synthetic",
  "eval_interval=-1",  # the last step's eval: not what these tests compare
  "per_device_batch_size=1",
  "steps=4",
  "num_slices=2",
  "dcn_data_parallelism=2",
  "ici_fsdp_parallelism=1",
  "enable_emergency_checkpoint=true",
  "local_checkpoint_period=2",
  "checkpoint_period=4",
  "run_name=em",
)
TIMEOUT_S = 180  # a run here takes about 20 s on 2 cores; a process waiting for a peer that gave up waits for good


def _run_job(root, log_name: str) -> tuple[list[int], list[str]]:
  """Both processes to the end; (exit codes, logs). Fails, naming the processes still running, after TIMEOUT_S."""
  args = (*ARGS, f"base_output_directory={root / 'runs'}", f"local_checkpoint_directory={root / 'local'}")
  args += (f"jax_cache_dir={root / 'jax_cache'}",)  # the resumed runs reuse the first run's compiled programs
  port, logs = free_port(), [str(root / f"{log_name}_{i}.log") for i in range(2)]
  workers = [procs.start(process_command(i, 2, port, (procs.BASE_YML, *args)), logs[i]) for i in range(2)]
  deadline = time.monotonic() + TIMEOUT_S
  try:
    codes = [w.wait(timeout=max(1.0, deadline - time.monotonic())) for w in workers]
  except subprocess.TimeoutExpired:
    waiting = [i for i, w in enumerate(workers) if w.poll() is None]
    for w in workers:
      procs.kill_group(w)
    tails = "\n".join(f"--- process {i}:\n{procs.tail(logs[i], lines=8)}" for i in range(2))
    raise AssertionError(f"process(es) {waiting} still running after {TIMEOUT_S}s:\n{tails}") from None
  return codes, [open(log, encoding="utf-8").read() for log in logs]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A finished run's files (persistent steps 2 and 4, process 1's local step 4) and a copy to restore them from."""
  root = tmp_path_factory.mktemp("emergency")
  codes, logs = _run_job(root, "first")
  assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
  assert sorted(os.listdir(root / "runs" / "em" / "data_positions")) == ["2", "4"]
  shutil.copytree(root / "runs", root / "saved_runs")
  shutil.copytree(root / "local", root / "saved_local")
  return root


def _resume_with_fault(saved, monkeypatch, fault: str, name: str) -> tuple[list[int], list[str]]:
  for part in ("runs", "local"):  # the files as the first run left them
    shutil.rmtree(saved / part)
    shutil.copytree(saved / f"saved_{part}", saved / part)
  monkeypatch.setenv(FAULT_ENV, fault)  # the processes inherit it; only process 1 acts on it
  return _run_job(saved, name)


def _errors(log: str) -> list[str]:
  return [line for line in log.splitlines() if line.startswith("error:")]


def test_a_step_only_one_process_cannot_read_stops_every_process_with_one_line(saved, monkeypatch):
  """Process 1's storage keeps failing on step 4's data positions (retried, then not the step's fault): both stop,
  each with one error line, process 0's naming process 1, instead of process 0 waiting in the restore."""
  codes, logs = _resume_with_fault(saved, monkeypatch, "1:4:transient:-1", "stop")
  assert codes == [2, 2], logs[0][-3000:] + logs[1][-3000:]
  errors = [_errors(log) for log in logs]
  assert len(errors[1]) == 1 and re.search(r"data_positions/4 could not be read after 5 attempt", errors[1][0])
  assert len(errors[0]) == 1 and "data_positions/4 failed on process [1] (its log says why)" in errors[0][0], errors
  assert all("resumed from checkpoint" not in log for log in logs)


def test_a_step_one_process_finds_unreadable_is_skipped_by_every_process(saved, monkeypatch):
  """Step 4's data positions are corrupt as process 1 reads them: both processes skip step 4 and resume from step 2
  together, and finish the run."""
  codes, logs = _resume_with_fault(saved, monkeypatch, "1:4:corrupt:-1", "fallback")
  assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
  for log in logs:
    assert "skipping checkpoint step 4 on every process, unreadable on process [1]" in log, log[-3000:]
    assert re.findall(r"resumed from checkpoint at step (\d+)", log) == ["2"], log[-3000:]
