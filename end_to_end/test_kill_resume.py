"""Real processes killed mid-run (SIGKILL, SIGTERM, during an async save) resume exactly.

Every run a test compares is a train.py process with the same number of visible devices: XLA's CPU
code may round differently when the process sees a different device count, so an in-process reference
(pytest sees 8 devices) is not a bit-for-bit reference for a 1-device process.
"""

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import orbax.checkpoint as ocp
import procs
import pytest

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out

TINY = (*procs.TINY, "enable_tensorboard=false")


def _run_losses(tmp_path, overrides, run_name, devices=1):
  """Run train.py to the end; {step: loss} of that run's metrics (later rows win)."""
  log = str(tmp_path / f"{run_name}.log")
  assert procs.run(procs.train_command(*overrides, f"run_name={run_name}"), log, devices=devices) == 0, procs.tail(log)
  return procs.losses(procs.metric_rows(str(tmp_path / run_name / "metrics.jsonl")))


def _killed_and_run_again(tmp_path, args, checkpoint_period, kill_after):
  """Run "b" on 8 devices with checkpoints, killed after step `kill_after`, then run again."""
  saving = ("enable_checkpointing=true", f"checkpoint_period={checkpoint_period}")
  command = procs.train_command(*args, "run_name=b", *saving)
  return procs.killed_and_run_again(
    command, str(tmp_path / "b"), str(tmp_path / "b.log"), kill_after, checkpoint_period, devices=8
  )


def test_sigkill_after_step_6_resumes_bit_for_bit(tmp_path):
  """fsdp=4 x tensor=2 on 8 devices, real grain data, checkpoint every 4 steps: steps 5 and 6 (and any the killed run
  logged after) run twice, before the kill and after the resume, with the same losses."""
  args = (
    *TINY,
    "dataset_type=grain",
    "per_device_batch_size=1",
    "ici_fsdp_parallelism=4",
    "ici_tensor_parallelism=2",
    "steps=12",
    f"base_output_directory={tmp_path}",
  )
  before, after = _killed_and_run_again(tmp_path, args, checkpoint_period=4, kill_after=6)
  killed, resumed = procs.losses(before), procs.losses(after)
  assert min(resumed) == 5 and max(resumed) == 12 and max(killed) >= 6
  replayed = range(5, max(killed) + 1)
  assert {s: resumed[s] for s in replayed} == {s: killed[s] for s in replayed}  # bit for bit
  assert len(set(resumed.values())) == len(resumed)  # a run that trains: every step its own loss


def test_sigkill_of_an_ensemble_resumes_every_member_bit_for_bit(tmp_path):
  """Four members, two per device group (ensemble=2 x fsdp=2 x tensor=2 on 8 devices), each on its own batches of
  real data (ensemble_data=distinct): killed after step 5, resumed from step 3, every member's loss in the replayed
  steps equals the killed run's."""
  args = (
    *TINY,
    "dataset_type=grain",
    "per_device_batch_size=1",
    "ensemble_size=4",
    "ici_ensemble_parallelism=2",
    "ici_fsdp_parallelism=2",
    "ici_tensor_parallelism=2",
    "ensemble_data=distinct",
    "steps=8",
    f"base_output_directory={tmp_path}",
  )

  def members(rows):
    return {r["step"]: [r[f"loss/member_{i}"] for i in range(4)] for r in rows if "loss" in r}

  before, after = _killed_and_run_again(tmp_path, args, checkpoint_period=3, kill_after=5)
  killed, resumed = members(before), members(after)
  assert min(resumed) == 4 and max(resumed) == 8 and max(killed) >= 5
  assert {s: resumed[s] for s in range(4, max(killed) + 1)} == {s: killed[s] for s in range(4, max(killed) + 1)}
  assert len({tuple(v) for v in resumed.values()}) == len(resumed) and len(set(killed[1])) == 4


def test_sigterm_saves_current_step_and_exits_0(tmp_path):
  args = (*TINY, "dataset_type=grain", "per_device_batch_size=4", f"base_output_directory={tmp_path}")
  run_args = (*args, "enable_checkpointing=true", "checkpoint_period=1000")
  metrics, log = str(tmp_path / "b" / "metrics.jsonl"), str(tmp_path / "b.log")
  proc = procs.start(procs.train_command(*run_args, "run_name=b", "steps=100000"), log)
  procs.wait_for_step(proc, metrics, 3, log)
  os.killpg(proc.pid, signal.SIGTERM)
  assert proc.wait(timeout=60) == 0, procs.tail(log)
  stopped_at = max(procs.losses(procs.metric_rows(metrics)))
  assert sorted(os.listdir(tmp_path / "b" / "checkpoints")) == [str(stopped_at)]
  resumed = _run_losses(tmp_path, (*run_args, f"steps={stopped_at + 2}"), "b")
  straight = _run_losses(tmp_path, (*args, f"steps={stopped_at + 2}"), "a")
  assert {s: resumed[s] for s in (stopped_at + 1, stopped_at + 2)} == {
    s: straight[s] for s in (stopped_at + 1, stopped_at + 2)
  }


@pytest.mark.parametrize(
  "sig, through_tee, status",
  [(signal.SIGINT, False, 130), (signal.SIGINT, True, 130), (signal.SIGHUP, True, 129), (signal.SIGTERM, True, 0)],
  ids=["ctrl_c", "ctrl_c_piped_through_tee", "hangup_piped_through_tee", "sigterm_piped_through_tee"],
)
def test_a_signal_saves_the_step_wherever_the_log_goes(tmp_path, sig, through_tee, status):
  """Ctrl-C (SIGINT to the terminal's process group), a hang-up and a scheduler's SIGTERM each save the step the run is
  on and stop it, also when the log goes through `| tee log` and the signal ends tee first (every later write to the
  pipe then fails with EPIPE); Ctrl-C and the hang-up exit 130 and 129 so `train && decode` stops there, SIGTERM 0;
  the same command resumes from the saved step (a second Ctrl-C: tests/training/test_training_math.py)."""
  args = (*TINY, "dataset_type=synthetic", "per_device_batch_size=4", f"base_output_directory={tmp_path}")
  run_args = (*args, "enable_checkpointing=true", "checkpoint_period=1000", "steps=100000")
  metrics, log, status_file = str(tmp_path / "b" / "metrics.jsonl"), str(tmp_path / "b.log"), tmp_path / "status"
  command = procs.train_command(*run_args, "run_name=b")
  if through_tee:  # as typed in a terminal: both in one process group, which the terminal's Ctrl-C signals
    train = " ".join(shlex.quote(a) for a in command)
    # The shell that records train.py's status ignores the signal itself (train.py installs its own handlers).
    record = f"{{ trap '' HUP TERM; {train} 2>&1; echo $? > {status_file}; }}"
    command = ["bash", "-c", f"{record} | tee {shlex.quote(log)}.tee"]
  proc = procs.start(command, log)
  procs.wait_for_step(proc, metrics, 3, log)
  os.killpg(proc.pid, sig)
  code = proc.wait(timeout=120)
  if through_tee:  # the outer shell may end at the signal, before train.py has saved and its status is written
    deadline = time.monotonic() + 120
    while not status_file.exists() or not status_file.read_text().strip():
      assert time.monotonic() < deadline, procs.tail(f"{log}.tee")
      time.sleep(0.2)
    code = int(status_file.read_text())
  shown = procs.tail(log if not through_tee else f"{log}.tee")
  assert code == status, shown
  stopped_at = max(procs.losses(procs.metric_rows(metrics)))
  assert stopped_at >= 3
  assert sorted(os.listdir(tmp_path / "b" / "checkpoints")) == [str(stopped_at)], shown
  if not through_tee:
    assert "Ctrl-C: the steps already started finish, then a checkpoint is saved" in shown
    assert re.search(rf"interrupted: saved a checkpoint at step {stopped_at} in \S+; run the same command", shown)
    assert procs.run(procs.train_command(*args, "run_name=b", f"steps={stopped_at + 1}"), log) == 0, procs.tail(log)
    assert max(procs.losses(procs.metric_rows(metrics))) == stopped_at + 1


def test_kill_during_async_save_keeps_previous_checkpoint(tmp_path):
  """Save every step with a model whose saves take longer than a step, kill while one is in flight."""
  args = (
    "dataset_type=synthetic",
    "max_target_length=32",
    "per_device_batch_size=1",
    "enable_tensorboard=false",
    "learning_rate_schedule_steps=16",
    "eval_interval=-1",
    "log_period=1",
    f"base_output_directory={tmp_path}",
  )
  run_args = (*args, "enable_checkpointing=true", "checkpoint_period=1", "max_num_checkpoints_to_keep=-1")
  ckpt_dir, log = tmp_path / "b" / "checkpoints", str(tmp_path / "b.log")
  proc = procs.start(procs.train_command(*run_args, "run_name=b", "steps=100000"), log)
  deadline, in_flight = time.monotonic() + 300, []
  while not in_flight and time.monotonic() < deadline and proc.poll() is None:
    names = os.listdir(ckpt_dir) if ckpt_dir.exists() else []
    in_flight = [n for n in names if "tmp" in n] if any(n.isdigit() for n in names) else []
    time.sleep(0.005)
  procs.kill_group(proc, signal.SIGKILL)
  assert in_flight, procs.tail(log)
  partial = [n for n in os.listdir(ckpt_dir) if "tmp" in n]
  assert partial, "the save finished before the kill; nothing partial to ignore"
  complete = max(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())
  assert all(int(n.split(".")[0]) > complete for n in partial)
  manager = ocp.CheckpointManager(str(ckpt_dir), options=ocp.CheckpointManagerOptions(read_only=True))
  assert manager.latest_step() == complete
  # The killed run is uninterrupted up to the kill, and a step's row is written before its save starts: the steps
  # after `complete` that it logged are the reference the resumed run must replay bit for bit.
  killed = procs.losses(procs.metric_rows(str(tmp_path / "b" / "metrics.jsonl")))
  replayed = range(complete + 1, max(killed) + 1)
  assert replayed, killed
  resumed = _run_losses(tmp_path, (*run_args, f"steps={max(killed) + 1}"), "b")
  assert {s: resumed[s] for s in replayed} == {s: killed[s] for s in replayed}


def test_a_failed_background_save_stops_the_run_with_one_line(tmp_path):
  """A save that cannot be written (a file-size limit here; a full disk or a quota alike) stops the run
  soon after, long before the next save, with one error line naming the step and the cause."""
  args = (
    *TINY,
    "dataset_type=synthetic",
    "per_device_batch_size=1",
    "steps=200",
    "checkpoint_period=100",
    "enable_checkpointing=true",
    "jax_cache_dir=",  # its files would meet the limit too
    f"base_output_directory={tmp_path}",
    "run_name=b",
  )
  log = str(tmp_path / "b.log")
  # Files of at most 1 MiB: the log and metrics fit, the 13 MiB train state does not (Python ignores SIGXFSZ,
  # so the write fails with EFBIG instead of killing the process).
  limited = ["bash", "-c", 'ulimit -f 1024 && exec "$@"', "bash", *procs.train_command(*args)]
  assert procs.run(limited, log) == 2, procs.tail(log)
  output = procs.tail(log, lines=500)
  assert "Traceback" not in output, output
  errors = [line for line in output.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, output
  assert re.match(r"error: saving checkpoint step 100 to \S+/checkpoints/100 failed \(\w+: .*File too large", errors[0])
  assert max(procs.losses(procs.metric_rows(str(tmp_path / "b" / "metrics.jsonl")))) < 200  # stopped early


def test_fault_trial_resumes_bit_identical_after_random_kills():
  """A small run of end_to_end/fault_trial.py (the README reports 20 trials of each kind). Seed 0's trial first
  kills the run while a save is in flight (its first draws pick that kind and step 9), then kills it once more."""
  trial = os.path.join(procs.REPO, "end_to_end", "fault_trial.py")
  proc = subprocess.run(
    [sys.executable, trial, "--trials", "1", "--storage", "local", "--processes", "1", "--seed", "0"],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  assert "trial 1/1: kills during_save@" in proc.stdout, proc.stdout
  assert "1/1 resumed bit-identical (1 process on local" in proc.stdout, proc.stdout
