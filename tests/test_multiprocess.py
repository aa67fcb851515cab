"""Several real processes joined by jax.distributed (gloo), started by MaxLite/launch_local.py."""

import os
import re
import signal
import time

import procs

TINY = ("model_name=tiny", "max_target_length=64", "enable_tensorboard=false", "learning_rate=1e-2",
        "learning_rate_schedule_steps=16", "eval_interval=-1", "log_period=1", "dataset_type=grain",
        "per_device_batch_size=1", "ici_fsdp_parallelism=8", "steps=8")


def _processes_mentioning(text: str) -> list[int]:
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if text.encode() in f.read():
          found.append(int(pid))
    except OSError:
      pass
  return found


def test_two_processes_killed_and_resumed_match_uninterrupted_run(tmp_path):
  args = (*TINY, f"base_output_directory={tmp_path}")
  log = str(tmp_path / "launch.log")
  assert procs.run(procs.launch_command(2, 4, *args, "run_name=a"), log) == 0, procs.tail(log)
  straight = procs.losses(procs.metric_rows(str(tmp_path / "a" / "metrics.jsonl")))
  assert sorted(straight) == list(range(1, 9))

  command = procs.launch_command(2, 4, *args, "run_name=b", "enable_checkpointing=true", "checkpoint_period=3")
  metrics = str(tmp_path / "b" / "metrics.jsonl")
  launcher = procs.start(command, log)
  procs.wait_for_step(launcher, metrics, 5, log)
  procs.kill_group(launcher, signal.SIGKILL)  # the launcher and both training processes
  deadline = time.monotonic() + 10
  while _processes_mentioning(f"base_output_directory={tmp_path}") and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not _processes_mentioning(f"base_output_directory={tmp_path}")
  assert sorted(os.listdir(tmp_path / "b" / "checkpoints"))[0] == "3"
  killed_at = os.path.getsize(metrics)

  assert procs.run(command, log) == 0, procs.tail(log)
  resumed = procs.losses(procs.metric_rows(metrics, offset=killed_at))
  assert max(resumed) == 8 and min(resumed) <= 6
  assert resumed == {s: straight[s] for s in resumed}  # bit for bit
  assert sorted(os.listdir(tmp_path / "b" / "checkpoints" / "8" / "data_iter")) == [
      "commit_success.txt", "process_0-of-2.json", "process_1-of-2.json"]


def test_sigterm_to_the_job_saves_the_same_step_on_every_process(tmp_path):
  """jax.distributed's preemption sync: both processes agree on the step, save it, exit 0."""
  args = (*TINY[:-1], "steps=100000", f"base_output_directory={tmp_path}", "run_name=p", "enable_checkpointing=true",
          "checkpoint_period=100000")
  metrics, log = str(tmp_path / "p" / "metrics.jsonl"), str(tmp_path / "launch.log")
  launcher = procs.start(procs.launch_command(2, 4, *args), log)
  procs.wait_for_step(launcher, metrics, 3, log)
  launcher.send_signal(signal.SIGTERM)  # the launcher forwards it to both processes
  assert launcher.wait(timeout=120) == 0, procs.tail(log)
  with open(log, encoding="utf-8") as f:
    saved = sorted(re.findall(r"\[p(\d)\] .*preempted: saved a checkpoint at step (\d+)", f.read()))
  assert [p for p, _ in saved] == ["0", "1"] and saved[0][1] == saved[1][1], saved
  assert os.listdir(tmp_path / "p" / "checkpoints") == [saved[0][1]]
