"""N train.py processes on this machine, joined by jax.distributed, as a multi-host job would run.

Each process simulates M CPU devices. Logs go to <run_dir>/logs/process_<i>.log; process 0's lines (the one that
logs metrics) also go to this terminal prefixed [p0], or every process's with --show_all_processes (the others
repeat process 0 and add gloo's connection noise). If any process fails the others are stopped, its last lines are
printed whoever it is, and the exit code is the worst.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import IO

from MaxLite import cli, storage
from MaxLite import config as config_lib
from MaxLite.cli.errors import UsageError
from MaxLite.config.keys_derived import default_run_name

TAIL_LINES = 20
# train.py of this installation (checkout or installed package), run as documented; `ps` shows train.py.
TRAIN_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")
STOP_GRACE_S = 10.0
# After the first failure, how long the others may take to exit on their own (their last lines say what they saw)
# before they are stopped; at most: the wait ends as soon as no process is left running. Which process is named as
# the cause does not depend on it (see _first_cause).
CAUSE_GRACE_S = 15.0
_PF_EXITING = 0x4  # a /proc/<pid>/stat flag: the process is in the kernel's exit path
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)  # in /proc/<pid>/status's pending-signal masks


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_command(index: int, num_processes: int, port: int, train_args: Sequence[str]) -> list[str]:
  """The train.py command line of process `index` (distributed keys go last, so they win)."""
  return [
    sys.executable,
    TRAIN_SCRIPT,
    *train_args,
    "skip_jax_distributed_system=false",
    f"coordinator_address=127.0.0.1:{port}",
    f"num_processes={num_processes}",
    f"process_id={index}",
  ]


def process_env(devices_per_process: int) -> dict[str, str]:
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"])
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONUNBUFFERED"] = "1"
  return env


def _die_with_parent() -> None:
  """Linux: the kernel kills the child if the launcher dies, so a killed launcher leaves no orphans."""
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
  except OSError:
    pass


class _Worker:
  def __init__(self, index: int, command: list[str], env: dict[str, str], log_path: str, echo: bool = True):
    self.index, self.log_path, self.echo = index, log_path, echo
    self.tail: deque[str] = deque(maxlen=TAIL_LINES)
    self.stopped = False  # the launcher signalled it while it was alive: how it then ended is the launcher's doing
    self.proc = subprocess.Popen(
      command,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      bufsize=1,
      preexec_fn=_die_with_parent,
    )
    self._pump = threading.Thread(target=self._copy_output, daemon=True)
    self._pump.start()

  def _copy_output(self) -> None:
    assert self.proc.stdout is not None
    with open(self.log_path, "w", encoding="utf-8") as log:
      for line in self.proc.stdout:
        log.write(line)
        log.flush()
        self.tail.append(line.rstrip("\n"))
        if self.echo:
          sys.stdout.write(f"[p{self.index}] {line}")
          sys.stdout.flush()

  def finish_output(self) -> None:
    self._pump.join(timeout=5)


def _dying(pid: int) -> bool:
  """Whether the kernel is already ending an unreaped child (Linux): a zombie, in its exit path, or with SIGKILL
  pending. False where /proc cannot say (other systems)."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
      fields = f.read().rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold spaces
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
      pending = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
  except (OSError, IndexError, ValueError):
    return False
  return fields[0] in "ZXx" or bool(int(fields[6]) & _PF_EXITING) or any(m & _SIGKILL_BIT for m in pending)


def _stop(workers: list[_Worker], sig: int) -> None:
  """Sends `sig` to the processes still running, SIGKILL to those left after STOP_GRACE_S; returns once every
  process is reaped. One the kernel is already ending (killed by someone else, its reap still to come) is left
  alone and waited for, however long its reap takes: its death must not count as the launcher's."""
  for w in workers:
    if w.proc.poll() is None and not _dying(w.proc.pid):
      w.stopped = True
      w.proc.send_signal(sig)
  deadline = time.monotonic() + STOP_GRACE_S
  for w in workers:
    try:
      w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      if not _dying(w.proc.pid):
        w.stopped = True
        w.proc.kill()
      w.proc.wait()


def _report_failure(w: _Worker, out: IO[str]) -> None:
  w.finish_output()
  out.write(f"launch_local: process {w.index} exited with code {w.proc.returncode}; last lines of {w.log_path}:\n")
  for line in w.tail:
    out.write(f"  | {line}\n")


def _killed_from_outside(w: _Worker) -> bool:
  return w.proc.returncode == -signal.SIGKILL and not w.stopped


def _first_cause(workers: list[_Worker], failed: list[_Worker]) -> _Worker:
  """The process to report as the cause, once `failed` (the first failures seen) have exited. Stops the others
  and decides when every process has been reaped.

  Neither the order of the exits seen nor a time limit can tell which process died first: the kernel closes a
  killed process's sockets before its exit can be reaped (tearing down a JAX process's memory takes seconds on a
  loaded machine, longer than any grace), so its peers' exits on the lost connection, with an error or an abort,
  are often reaped first. How each process ended can: a process does not SIGKILL itself when a peer goes away, so
  a SIGKILL the launcher did not send (a user, the OOM killer, a scheduler) is the cause whenever it is reaped.
  Otherwise the cause is among the first failures seen, a signal death before an error exit; processes that the
  launcher stopped come last.
  """
  first_seen = set(failed)
  deadline = time.monotonic() + CAUSE_GRACE_S
  while (
    not any(_killed_from_outside(w) for w in workers)  # nothing can come before it
    and any(w.proc.poll() is None for w in workers)
    and time.monotonic() < deadline
  ):
    time.sleep(0.05)
  _stop(workers, signal.SIGTERM)
  return min(
    (w for w in workers if w.proc.returncode != 0),
    key=lambda w: (not _killed_from_outside(w), w.stopped, w not in first_seen, w.proc.returncode >= 0, w.index),
  )


def launch(
  num_processes: int, devices_per_process: int, train_args: Sequence[str], log_dir: str, show_all: bool = False
) -> int:
  """Start the processes and wait; returns the worst exit code (non-zero as soon as one fails). Process 0's output
  goes to the terminal too (every process's with show_all)."""
  os.makedirs(log_dir, exist_ok=True)
  port, env = free_port(), process_env(devices_per_process)
  workers = [
    _Worker(
      i,
      process_command(i, num_processes, port, train_args),
      env,
      os.path.join(log_dir, f"process_{i}.log"),
      echo=show_all or i == 0,
    )
    for i in range(num_processes)
  ]
  forwarded: list[int] = []

  def forward(signum: int, frame: object) -> None:
    del frame
    forwarded.append(signum)
    for w in workers:
      if w.proc.poll() is None:
        w.proc.send_signal(signum)

  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    while True:
      codes = [w.proc.poll() for w in workers]
      failed = [w for w, c in zip(workers, codes) if c not in (None, 0)]
      if failed and not forwarded:
        _report_failure(_first_cause(workers, failed), sys.stderr)
        break
      if all(c is not None for c in codes):
        break
      time.sleep(0.2)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    _stop(workers, signal.SIGKILL)
    for w in workers:
      w.finish_output()
  return max((abs(w.proc.returncode) for w in workers), default=0)


def run(argv: Sequence[str], doc: str) -> int:
  """The launch_local.py command line: flags, then train.py's CONFIG.yml [key=value ...]."""
  parser = cli.FlagParser(doc)
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=4)
  parser.add_argument("--log_dir", default="", help="default: <base_output_directory>/<run_name>/logs")
  parser.add_argument(
    "--show_all_processes", action="store_true", help="print every process's lines here, not only process 0's"
  )
  parser.add_argument("train_args", nargs=argparse.REMAINDER, help="CONFIG.yml [key=value ...] as for train.py")
  args = parser.parse_args(argv)
  if args.num_processes < 1 or args.devices_per_process < 1:
    raise UsageError("--num_processes and --devices_per_process must be at least 1")
  if not args.train_args:
    raise UsageError(f"usage: {cli.usage_line(doc, parser.prog)} (see {parser.prog} --help)")
  raw = config_lib.load_raw(args.train_args)
  train_args = list(args.train_args)
  run_name = raw["run_name"]
  if not run_name:  # one name for every process (and for the log folder)
    run_name = default_run_name()
    train_args.append(f"run_name={run_name}")
  log_dir = args.log_dir or storage.join(storage.absolute(raw["base_output_directory"]), run_name, "logs")
  if not storage.is_url(log_dir):
    return launch(args.num_processes, args.devices_per_process, train_args, log_dir, args.show_all_processes)
  # Logs are written as they come, which an object store cannot do: keep them here, copy them up at the end.
  with tempfile.TemporaryDirectory(prefix=f"{run_name}-logs-") as local_logs:
    try:
      return launch(args.num_processes, args.devices_per_process, train_args, local_logs, args.show_all_processes)
    finally:
      for name in sorted(os.listdir(local_logs)):
        with open(os.path.join(local_logs, name), "rb") as f:
          storage.write_bytes(storage.join(log_dir, name), f.read())
      print(f"launch_local: logs copied to {log_dir}", flush=True)
