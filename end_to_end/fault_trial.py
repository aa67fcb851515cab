"""Fault trial: kill training at random moments, restart it until it finishes, and compare every logged loss
with an uninterrupted run, bit for bit.

  python end_to_end/fault_trial.py --trials 20 --storage local --processes 1
  python end_to_end/fault_trial.py --trials 20 --storage gs --processes 2
  python end_to_end/fault_trial.py --trials 20 --storage gs --processes 2 --emergency

Each trial is a fresh run directory. Until the run exits 0, the trial starts it, waits a random number of
logged steps, and kills it one of three ways: SIGKILL of the whole job, SIGKILL of one process of two (the
launcher then stops the other), or SIGKILL right as a step that saves is logged (the save is in flight). The
losses in the run's metrics.jsonl (a step logged twice keeps its last value) must equal the reference run's.
gs:// runs on a local GCS server (fake-gcs-server). Prints one line per trial and `k/N resumed bit-identical`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import procs  # noqa: E402
from gcs import LocalGCS  # noqa: E402

BUCKET = "fault-trial"
STEPS, PERIOD = 12, 3
_LOGGED_STEP = re.compile(r"step\s+(\d+)(?:/\d+)? \| loss")
KILLS = ("job", "one_process", "during_save")


def _args(storage: str, processes: int, emergency_dir: str = "") -> tuple[str, ...]:
  base = f"gs://{BUCKET}/runs" if storage == "gs" else None
  args = (
    *procs.TINY,
    "dataset_type=grain",
    "enable_tensorboard=false",
    "enable_checkpointing=true",
    f"checkpoint_period={PERIOD}",
    f"steps={STEPS}",
    f"per_device_batch_size={1 if processes == 2 else 4}",
  )
  if emergency_dir:  # each process one data replica, saving locally every 2 steps, persistently every PERIOD
    args += ("num_slices=2", "dcn_data_parallelism=2", "ici_fsdp_parallelism=4", "enable_emergency_checkpoint=true")
    args += (f"local_checkpoint_directory={emergency_dir}", "local_checkpoint_period=2")
  elif processes == 2:
    args += ("ici_fsdp_parallelism=8",)
  return args + ((f"base_output_directory={base}",) if base else ())


def _command(args: tuple[str, ...], processes: int, run_name: str, out: str) -> list[str]:
  extra = (f"run_name={run_name}",)
  if not any(a.startswith("base_output_directory=") for a in args):
    extra += (f"base_output_directory={out}",)
  if processes == 1:
    return procs.train_command(*args, *extra)
  return procs.launch_command(2, 4, *args, *extra)


def _children(pid: int) -> list[int]:
  found = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
          if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
      except (OSError, IndexError, ValueError):
        pass
  return found


def _logged_steps(log: str) -> list[int]:
  with open(log, encoding="utf-8", errors="replace") as f:
    return [int(m.group(1)) for m in _LOGGED_STEP.finditer(f.read())]


class Trial:
  def __init__(self, storage: str, processes: int, workdir: str, gcs: LocalGCS | None, emergency: bool):
    self.storage, self.processes, self.workdir, self.gcs = storage, processes, workdir, gcs
    self.save_every = 2 if emergency else PERIOD
    self.args = _args(storage, processes, os.path.join(workdir, "local") if emergency else "")
    self.env = procs.env_with_devices(1)  # the launcher gives each of two processes 4 devices
    if gcs is not None:
      self.env.update(gcs.env, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")

  def start(self, run_name: str, log: str) -> subprocess.Popen:
    command = _command(self.args, self.processes, run_name, self.workdir)
    return subprocess.Popen(
      command, env=self.env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True
    )

  def losses(self, run_name: str) -> dict[int, float]:
    if self.gcs is not None:
      text = self.gcs.read(BUCKET, f"runs/{run_name}/metrics.jsonl").decode()
    else:
      with open(os.path.join(self.workdir, run_name, "metrics.jsonl"), encoding="utf-8") as f:
        text = f.read()
    return procs.losses([json.loads(line) for line in text.splitlines() if line.strip()])

  def run_to_end(self, run_name: str, log: str, timeout: float = 600) -> None:
    proc = self.start(run_name, log)
    try:
      code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      procs.kill_group(proc)
      raise
    if code != 0:
      raise RuntimeError(f"{run_name} exited with {code}:\n{procs.tail(log)}")

  def interrupted(self, run_name: str, log: str, rng: random.Random, max_starts: int = 8) -> list[str]:
    """Starts and kills the run until it exits 0; the kills made, e.g. ['job@5', 'during_save@9']."""
    kills: list[str] = []
    for _ in range(max_starts):
      logged = _logged_steps(log) if os.path.exists(log) else []
      before, done = len(logged), max(logged, default=0)
      if done >= STEPS - 1 or len(kills) >= 3:
        self.run_to_end(run_name, log)
        return kills
      kind = rng.choice([k for k in KILLS if k != "one_process" or self.processes == 2])
      target = rng.randint(done + 1, STEPS - 1)
      if kind == "during_save":  # the next step that saves, if one comes before the last step
        save_step = -(-target // self.save_every) * self.save_every
        kind, target = ("during_save", save_step) if save_step < STEPS else ("job", target)
      proc = self.start(run_name, log)
      deadline = time.monotonic() + 600
      while time.monotonic() < deadline and proc.poll() is None:
        steps = _logged_steps(log)[before:]
        if steps and max(steps) >= target:
          break
        time.sleep(0.01)
      if proc.poll() is not None:  # finished before the kill
        if proc.returncode != 0:
          raise RuntimeError(f"{run_name} exited with {proc.returncode}:\n{procs.tail(log)}")
        return kills
      if kind == "one_process":
        workers = _children(proc.pid)
        if workers:
          os.kill(rng.choice(workers), signal.SIGKILL)
          try:
            proc.wait(timeout=120)  # the launcher stops the other process and exits
          except subprocess.TimeoutExpired:
            pass
      procs.kill_group(proc, signal.SIGKILL)
      kills.append(f"{kind}@{max(_logged_steps(log)[before:], default=0)}")
    raise RuntimeError(f"{run_name}: not finished after {max_starts} starts")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--trials", type=int, default=3)
  parser.add_argument("--storage", choices=("local", "gs"), default="local")
  parser.add_argument("--processes", type=int, choices=(1, 2), default=1)
  parser.add_argument("--emergency", action="store_true", help="emergency checkpoints (needs --processes 2)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--workdir", default="", help="where runs go (default: a temporary directory, removed)")
  flags = parser.parse_args()
  if flags.emergency and flags.processes != 2:
    parser.error("--emergency needs --processes 2 (one data replica per process)")
  workdir = flags.workdir or tempfile.mkdtemp(prefix="fault_trial_")
  os.makedirs(workdir, exist_ok=True)
  rng = random.Random(flags.seed)
  start = time.monotonic()
  gcs = None
  try:
    if flags.storage == "gs":
      gcs = LocalGCS(os.path.join(workdir, "gcs")).__enter__()
      gcs.create_bucket(BUCKET)  # outputs only: the runs read the shipped corpus and tokenizer
    trial = Trial(flags.storage, flags.processes, workdir, gcs, flags.emergency)
    trial.run_to_end("reference", os.path.join(workdir, "reference.log"))
    reference = trial.losses("reference")
    assert sorted(reference) == list(range(1, STEPS + 1)), reference
    identical = 0
    for k in range(flags.trials):
      run_name, log = f"trial_{k}", os.path.join(workdir, f"trial_{k}.log")
      t0 = time.monotonic()
      kills = trial.interrupted(run_name, log, rng)
      same = trial.losses(run_name) == reference
      identical += same
      print(
        f"trial {k + 1}/{flags.trials}: kills {', '.join(kills) or 'none'} -> "
        f"{'bit-identical' if same else 'DIFFERENT'} ({time.monotonic() - t0:.0f}s)",
        flush=True,
      )
    mode = f"{flags.processes} process{'es' if flags.processes > 1 else ''} on {flags.storage}"
    mode += ", emergency checkpoints" if flags.emergency else ""
    print(f"{identical}/{flags.trials} resumed bit-identical ({mode}, {time.monotonic() - start:.0f}s)", flush=True)
    return 0 if identical == flags.trials else 1
  finally:
    if gcs is not None:
      gcs.__exit__()
    if not flags.workdir:
      shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main())
