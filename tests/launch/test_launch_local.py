"""launch_local's report of which process failed first, with small Python scripts standing in for train.py (no JAX).

The launcher runs its real loop (MaxLite.launch.local.launch) on real child processes; only the script it starts is
a stand-in, chosen by TRAIN_SCRIPT.
"""

import os
import signal
import sys
import time

import pytest

from MaxLite.launch import local

# Process 0 serves a socket, process 1 connects: the lost connection a real job's peers see when one process dies.
WORKER = r"""
import ctypes, os, resource, signal, socket, subprocess, sys, time

args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
index, path = int(args["process_id"]), args["sock"]
if index == 0:
  server = socket.socket(socket.AF_UNIX)
  server.bind(path)
  server.listen(1)
  conn, _ = server.accept()
  print("connected", flush=True)
  if args["scenario"] == "own_error":
    print("error: process 0 failed on its own", flush=True)
    sys.exit(3)
  conn.recv(1)  # b"" once process 1 is gone
  print("error: lost the connection to process 1", flush=True)
  if args["peer_exit"] == "abort":  # as JAX's coordination client does on a lost peer (a fatal log: SIGABRT)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()
  sys.exit(1)

client = socket.socket(socket.AF_UNIX)
while client.connect_ex(path) != 0:
  time.sleep(0.01)
if args["scenario"] == "own_error":  # hung: ignores the launcher's SIGTERM, as a process stuck in a collective does
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  print("hung", flush=True)
  time.sleep(600)
# A tracer holds process 1's exit for hide_s seconds after its SIGKILL: it is dead (its socket closed, so process 0
# fails at once) but its parent, the launcher, cannot reap it yet, as with a big process torn down on a loaded machine.
ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(2**64 - 1), 0, 0, 0)  # PR_SET_PTRACER_ANY, for Yama
tracer = subprocess.Popen(
  [sys.executable, "-c", TRACER, str(os.getpid()), args["hide_s"]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
)
answer = tracer.stdout.readline().decode().strip()
if answer != "attached":
  print(f"no ptrace: {answer}", flush=True)
  sys.exit(4)
print("killed by SIGKILL", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

TRACER = r"""
import ctypes, sys, time

libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(0x4206, int(sys.argv[1]), None, None) != 0:  # PTRACE_SEIZE: the tracee runs on
  print(f"ptrace(PTRACE_SEIZE) failed with errno {ctypes.get_errno()}", flush=True)
  sys.exit(1)
print("attached", flush=True)
sys.stdout.close()
time.sleep(float(sys.argv[2]))  # exiting detaches: the kernel then hands the dead process to its parent
"""


def _launch(tmp_path, monkeypatch, capsys, *args: str) -> tuple[int, str]:
  script = tmp_path / "worker.py"
  script.write_text(f"TRACER = {TRACER!r}\n{WORKER}")
  monkeypatch.setattr(local, "TRAIN_SCRIPT", str(script))
  sock = f"/tmp/maxlite-launch-{os.getpid()}-{time.monotonic_ns()}.sock"  # AF_UNIX paths are short: not tmp_path
  try:
    code = local.launch(2, 1, [f"sock={sock}", *args], str(tmp_path / "logs"))
  finally:
    if os.path.exists(sock):
      os.remove(sock)
  report = capsys.readouterr().err
  if "no ptrace:" in (tmp_path / "logs" / "process_1.log").read_text():
    pytest.skip(f"this machine does not allow ptrace: {(tmp_path / 'logs' / 'process_1.log').read_text()}")
  return code, report


@pytest.mark.slow
@pytest.mark.parametrize("peer_exit", ["error", "abort"])
def test_the_killed_process_is_named_though_its_peer_fails_and_is_reaped_first(
  tmp_path, monkeypatch, capsys, peer_exit
):
  """Process 1 is SIGKILLed; process 0 then fails on the lost connection (exit 1, or an abort: a signal death too) and
  is reaped first, while process 1's exit is held for 3 s, longer than the launcher lets the others exit on their own.
  The launcher must name process 1 (what it polls first, or how long it waits, must not decide)."""
  monkeypatch.setattr(local, "CAUSE_GRACE_S", 1.0)
  start = time.monotonic()
  code, report = _launch(tmp_path, monkeypatch, capsys, "scenario=killed", f"peer_exit={peer_exit}", "hide_s=3")
  assert "launch_local: process 1 exited with code -9; last lines of" in report, report
  assert "launch_local: process 0" not in report and "  | killed by SIGKILL" in report, report
  assert code == 9 and time.monotonic() - start < 30


def test_a_process_the_launcher_had_to_kill_is_not_the_cause(tmp_path, monkeypatch, capsys):
  """Process 0 fails on its own; process 1 hangs and ignores SIGTERM, so the launcher SIGKILLs it: that SIGKILL is the
  launcher's, and process 0 stays the one named."""
  monkeypatch.setattr(local, "CAUSE_GRACE_S", 0.5)
  monkeypatch.setattr(local, "STOP_GRACE_S", 1.0)
  code, report = _launch(tmp_path, monkeypatch, capsys, "scenario=own_error", "peer_exit=error", "hide_s=0")
  assert "launch_local: process 0 exited with code 3; last lines of" in report, report
  assert "  | error: process 0 failed on its own" in report and "launch_local: process 1" not in report, report
  assert code == 9  # the worst exit: process 1's SIGKILL


def test_a_dying_process_is_told_apart_from_a_running_one(tmp_path):
  """What the launcher reads in /proc to leave a process already being killed alone (no signal, no blame of its own)."""
  import subprocess

  proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    assert not local._dying(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not local._dying(proc.pid) and time.monotonic() < deadline:
      time.sleep(0.01)
    assert local._dying(proc.pid)  # a zombie its parent has not reaped yet
  finally:
    proc.kill()
    proc.wait()
  assert not local._dying(proc.pid)  # reaped: gone from /proc


def test_only_process_0_is_echoed_unless_all_are_asked_for(tmp_path, capfd):
  """Every process's lines (the same log repeated N times, plus gloo's noise) went to the terminal; now process 0's
  do, and all of them are still in the log files."""
  from MaxLite.launch import local

  say = [sys.executable, "-c", "print('hello')"]
  workers = [local._Worker(i, say, dict(os.environ), str(tmp_path / f"p{i}.log"), echo=i == 0) for i in range(2)]
  for w in workers:
    w.proc.wait(timeout=30)
    w.finish_output()
  out = capfd.readouterr().out
  assert "[p0] hello" in out and "[p1]" not in out
  assert all(open(tmp_path / f"p{i}.log").read() == "hello\n" for i in range(2))
