"""One writer per run directory: a live run's directory is refused to a second run, naming the owner;
a lock left by a dead run is taken over; the lock goes when the run ends (normally, SIGTERM, an error)."""

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from support.config import TINY, first_devices, make_config
from support.end_to_end import LocalGCS, procs

from MaxLite.cli.errors import ConfigError
from MaxLite.training import run_lock

RUN = (*TINY, "per_device_batch_size=1", "dataset_type=synthetic", "eval_interval=-1", "run_name=r")


def _error_lines(log: str) -> list[str]:
  with open(log, encoding="utf-8", errors="replace") as f:
    return [line.rstrip("\n") for line in f if line.startswith("error:")]


def _dead_pid() -> int:
  """The pid of a process that has exited and been reaped."""
  proc = subprocess.Popen(["true"])
  proc.wait()
  return proc.pid


@pytest.mark.slow
def test_a_second_run_on_a_live_run_directory_stops_with_one_line(tmp_path):
  lock, metrics = tmp_path / "r" / run_lock.LOCK_FILE, str(tmp_path / "r" / "metrics.jsonl")
  args = (*RUN, f"base_output_directory={tmp_path}", "enable_checkpointing=true", "checkpoint_period=100000")
  first_log, second_log = str(tmp_path / "first.log"), str(tmp_path / "second.log")
  first = procs.start(procs.train_command(*args, "steps=100000"), first_log)
  try:
    procs.wait_for_step(first, metrics, 2, first_log)
    assert procs.run(procs.train_command(*args, "steps=3"), second_log) == 2, procs.tail(second_log)
    errors = _error_lines(second_log)
    assert len(errors) == 1, procs.tail(second_log)
    assert f"run directory {tmp_path / 'r'} is in use by pid {first.pid} on host {socket.gethostname()}" in errors[0]
    assert "Traceback" not in procs.tail(second_log, lines=200)
    assert first.poll() is None  # the refused run wrote nothing the live run minds
  finally:
    if first.poll() is None:
      os.killpg(first.pid, signal.SIGTERM)  # the SIGTERM path: save, release the lock, exit 0
  assert first.wait(timeout=120) == 0, procs.tail(first_log)
  assert not lock.exists()
  stopped_at = max(procs.losses(procs.metric_rows(metrics)))
  assert procs.run(procs.train_command(*args, f"steps={stopped_at + 1}"), second_log) == 0, procs.tail(second_log)
  assert max(procs.losses(procs.metric_rows(metrics))) == stopped_at + 1
  assert not lock.exists()


@pytest.mark.slow
def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path):
  lock, metrics = tmp_path / "r" / run_lock.LOCK_FILE, str(tmp_path / "r" / "metrics.jsonl")
  args = (*RUN, f"base_output_directory={tmp_path}")
  log = str(tmp_path / "log")
  killed = procs.start(procs.train_command(*args, "steps=100000"), log)
  procs.wait_for_step(killed, metrics, 1, log)
  procs.kill_group(killed, signal.SIGKILL)
  assert json.loads(lock.read_text())["pid"] == killed.pid  # left behind
  assert procs.run(procs.train_command(*args, "steps=2"), log) == 0, procs.tail(log)
  output = procs.tail(log, lines=400)
  assert f"taking over the lock of a run that is no longer running: pid {killed.pid} on host" in output, output
  assert not lock.exists()


def test_a_killed_owner_not_yet_reaped_holds_no_lock():
  """A SIGKILLed run stays a zombie until its parent reaps it; a restart on the same host must not wait for that."""
  child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    assert run_lock._pid_alive(child.pid)
    child.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not run_lock._zombie(child.pid):
      time.sleep(0.01)
    os.kill(child.pid, 0)  # not reaped yet: the pid still exists
    assert not run_lock._pid_alive(child.pid)
  finally:
    child.wait()


def _config(tmp_path, *overrides):
  return make_config(*RUN, f"base_output_directory={tmp_path}", *overrides)


def test_lock_records_the_owner_refuses_a_second_holder_and_is_released_on_error(tmp_path, caplog):
  config = _config(tmp_path)
  path = tmp_path / "r" / run_lock.LOCK_FILE
  path.parent.mkdir()
  path.write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "started": "then"}))
  with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="boom"):
    with run_lock.hold(config):
      owner = json.loads(path.read_text())
      assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname() and owner["started"]
      with pytest.raises(
        ConfigError, match=rf"is in use by pid {os.getpid()} on host .*\(started {re.escape(owner['started'])}\)"
      ):
        run_lock.acquire(config)  # a second open of the file: flock refuses it as it would another process
      raise RuntimeError("boom")
  assert any("taking over the lock of a run that is no longer running" in r.getMessage() for r in caplog.records)
  assert not path.exists()


@pytest.mark.slow
@pytest.mark.parametrize("under", ["file", "proc"])
def test_an_unwritable_output_directory_is_one_line_at_start(tmp_path, under):
  if under == "file":
    (tmp_path / "afile").write_text("")
    base = tmp_path / "afile" / "out"
  else:
    base = "/proc/maxlite_outputs"  # nobody, root included, can create entries there
  log = str(tmp_path / "log")
  assert procs.run(procs.train_command(*RUN, f"base_output_directory={base}", "steps=1"), log) == 2, procs.tail(log)
  errors = _error_lines(log)
  assert len(errors) == 1, procs.tail(log)
  assert errors[0].startswith(f"error: base_output_directory={base}: cannot write the run directory {base}/r ("), errors
  assert "Traceback" not in procs.tail(log, lines=200)


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
  with LocalGCS(str(tmp_path_factory.mktemp("gcs"))) as server:
    previous = dict(os.environ)  # the emulator settings below must not leak into later tests' processes
    os.environ.update(server.env)
    from MaxLite import storage

    storage.use_storage_emulator_if_set()
    try:
      yield server, server.create_bucket("locks")
    finally:
      os.environ.clear()
      os.environ.update(previous)


def test_gs_lock_refuses_a_live_owner_and_takes_over_a_stale_one(bucket, caplog):
  server, url = bucket
  config = make_config(*RUN, f"base_output_directory={url}/runs")
  name = f"runs/r/{run_lock.LOCK_FILE}"
  lock = run_lock.acquire(config)
  try:
    owner = json.loads(server.read("locks", name))
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    with pytest.raises(ConfigError, match=rf"in use by pid {os.getpid()} .*last heartbeat \d+s ago"):
      run_lock.acquire(config)
  finally:
    lock.release()
  assert server.objects("locks", "runs/r/") == []

  def other(**fields):
    record = {"pid": 1, "host": "elsewhere", "started": "then", "heartbeat": time.time(), "token": "x", **fields}
    server.upload("locks", name, json.dumps(record).encode())

  other()  # alive on another host, as far as anyone here can tell
  with pytest.raises(ConfigError, match=r"in use by pid 1 on host elsewhere \(started then\), last heartbeat"):
    run_lock.acquire(config)
  for stale, reason in (
    ({"heartbeat": time.time() - run_lock.STALE_AFTER_S - 60}, "no heartbeat for"),
    ({"host": socket.gethostname(), "pid": _dead_pid()}, "that pid is no longer running on this host"),
  ):
    other(**stale)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      lock = run_lock.acquire(config)
    assert any(reason in r.getMessage() for r in caplog.records), caplog.text
    assert json.loads(server.read("locks", name))["pid"] == os.getpid()
    lock.release()


def _foreign_lock(**fields):
  record = {"pid": 1, "host": "elsewhere", "started": "then", "heartbeat": time.time(), "token": "x", **fields}
  return json.dumps(record).encode()


def test_gs_lock_writes_only_over_its_own_generation(bucket):
  server, url = bucket
  path = f"{url}/gen/{run_lock.LOCK_FILE}"
  from MaxLite import storage

  storage.create_new(path, "mine")
  text, generation = storage.read_generation(path)
  assert text == "mine"
  server.upload("locks", f"gen/{run_lock.LOCK_FILE}", b"theirs")  # a new owner, between our read and our write
  assert storage.replace_generation(path, "mine again", generation) is None
  assert server.read("locks", f"gen/{run_lock.LOCK_FILE}") == b"theirs"
  text, current = storage.read_generation(path)
  assert storage.replace_generation(path, "mine again", current) not in (None, current)


def test_gs_heartbeat_never_overwrites_a_new_owner_and_marks_the_lock_lost(bucket, monkeypatch, caplog):
  server, url = bucket
  monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
  config = make_config(*RUN, f"base_output_directory={url}/beat")
  name = f"beat/r/{run_lock.LOCK_FILE}"
  lock = run_lock.acquire(config)
  try:
    time.sleep(0.3)  # a few beats of our own
    assert lock.lost() is None and json.loads(server.read("locks", name))["pid"] == os.getpid()
    server.upload("locks", name, _foreign_lock())
    with caplog.at_level(logging.ERROR):
      time.sleep(0.3)
    assert json.loads(server.read("locks", name))["host"] == "elsewhere"
    assert "was taken over by pid 1 on host elsewhere (started then)" in lock.lost()
  finally:
    lock.release()
  assert json.loads(server.read("locks", name))["host"] == "elsewhere"  # not ours to remove


@pytest.mark.slow
def test_a_run_whose_gs_lock_is_taken_over_stops_before_its_next_save(bucket, tmp_path):
  server, url = bucket
  args = (*RUN, f"base_output_directory={url}/runs", "run_name=taken", "enable_checkpointing=true")
  log = str(tmp_path / "log")
  run = procs.start(procs.train_command(*args, "checkpoint_period=10", "steps=100000"), log)
  deadline = time.monotonic() + 120
  while "runs/taken/checkpoints/10/commit_success.txt" not in server.objects("locks", "runs/taken/checkpoints/10/"):
    assert run.poll() is None and time.monotonic() < deadline, procs.tail(log)
    time.sleep(0.05)
  server.upload("locks", f"runs/taken/{run_lock.LOCK_FILE}", _foreign_lock())  # as a later run takes a stale lock
  assert run.wait(timeout=120) == 2, procs.tail(log)
  errors = _error_lines(log)
  assert len(errors) == 1, procs.tail(log)
  match = re.search(r"taken over by pid 1 on host elsewhere .*; stopping without saving step (\d+)", errors[0])
  assert match, errors
  saved = {int(n.split("/")[3]) for n in server.objects("locks", "runs/taken/checkpoints/")}
  assert max(saved) < int(match.group(1)), (saved, errors)
  assert json.loads(server.read("locks", f"runs/taken/{run_lock.LOCK_FILE}"))["host"] == "elsewhere"


@pytest.mark.slow
def test_every_process_of_a_job_stops_when_process_0_is_refused_the_lock(bucket, tmp_path):
  server, url = bucket
  server.upload("locks", f"runs/busy/{run_lock.LOCK_FILE}", _foreign_lock())
  log = str(tmp_path / "log")
  command = procs.launch_command(2, 1, *RUN, f"base_output_directory={url}/runs", "run_name=busy", "steps=3")
  assert procs.run(command, log, timeout=180) != 0
  output = procs.tail(log, lines=400)
  assert re.search(r"error: run directory \S+/runs/busy is in use by pid 1 on host elsewhere", output), output
  assert "process 0 could not take its lock" in output, output
  assert "Traceback" not in output, output


def _silent_bucket(*args, **kwargs):
  raise ConnectionResetError("injected: the bucket does not answer")


def test_gs_lock_is_lost_once_its_heartbeat_has_failed_for_the_stale_time(bucket, monkeypatch):
  """Within the stale time a failed beat or read is tolerated: nobody may take over a lock whose heartbeat is that
  fresh. After it another run may have taken the lock, so this run must count it as lost, bucket or no bucket."""
  from MaxLite import storage

  server, url = bucket
  monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
  monkeypatch.setattr(run_lock, "STALE_AFTER_S", 1.5)
  lock = run_lock.acquire(make_config(*RUN, f"base_output_directory={url}/silent"))
  try:
    monkeypatch.setattr(storage, "replace_generation", _silent_bucket)
    monkeypatch.setattr(storage, "read_generation", _silent_bucket)
    time.sleep(0.2)
    assert lock.lost() is None  # failed beats and a failed read, well inside the stale time
    time.sleep(run_lock.STALE_AFTER_S)
    reason = lock.lost()
    assert re.search(r"silent/r/run.lock had no successful heartbeat for \d+s .*ConnectionResetError", reason or "")
  finally:
    monkeypatch.undo()
    lock.release()
  assert server.objects("locks", "silent/") == []


def test_a_hung_bucket_request_holds_up_no_save_past_the_locks_deadline(bucket, monkeypatch):
  """A heartbeat whose request never returns held the lock's mutex, and lost(), which every process's save waits
  on, waited for it as long as it hung. Every request is now bounded by the time left before the lock would count
  as lost: lost() answers by then, with the lock counted as lost, and the lock still releases."""
  from MaxLite import storage

  server, url = bucket
  monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
  monkeypatch.setattr(run_lock, "STALE_AFTER_S", 1.0)
  lock = run_lock.acquire(make_config(*RUN, f"base_output_directory={url}/hung"))
  never = threading.Event()
  try:
    hang = lambda *args, **kwargs: never.wait()  # noqa: E731
    monkeypatch.setattr(storage, "replace_generation", hang)
    monkeypatch.setattr(storage, "read_generation", hang)
    time.sleep(0.2)  # the heartbeat's request is now hanging
    answers = []
    asking = threading.Thread(target=lambda: answers.append(lock.lost()), daemon=True)
    started = time.monotonic()
    asking.start()
    asking.join(timeout=10)
    assert answers, "lost() still waits on the hung request"
    assert time.monotonic() - started < 2 * run_lock.STALE_AFTER_S
    assert re.search(r"hung/r/run.lock had no successful heartbeat for \d+s", answers[0] or ""), answers
  finally:
    never.set()
    monkeypatch.undo()
    lock.release()


def test_metrics_are_not_written_once_the_lock_is_lost(bucket, monkeypatch):
  """Rows waiting for their upload to the bucket are dropped too: the run that took the lock over may have rewritten
  metrics.jsonl since, and an upload would replace its rows with this run's."""
  from MaxLite import storage
  from MaxLite.training.metrics import StepLog

  server, url = bucket
  monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
  monkeypatch.setattr(run_lock, "STALE_AFTER_S", 0.5)
  config = make_config(*RUN, f"base_output_directory={url}/rows", "log_period=1")
  metrics = {"loss": 2.0, "learning_rate": 1e-3, "grad_norm": 1.0}
  with pytest.raises(run_lock.LockLostError, match=r"no successful heartbeat .*; stopping before writing the metrics"):
    with run_lock.hold(config) as guard, StepLog(config, guard) as log:
      for step in (1, 2, 3):
        log.record(step, metrics)  # rows 1 and 2 wait in memory for their upload
      monkeypatch.setattr(storage, "replace_generation", _silent_bucket)
      time.sleep(run_lock.STALE_AFTER_S + 0.1)
      log.record(4, metrics)
  assert [r["step"] for r in log.rows] == [1, 2]
  assert server.objects("locks", "rows/") == []  # neither the rows nor the lock


@pytest.mark.slow
def test_a_run_without_checkpoints_checks_its_lock_before_writing_metrics(bucket, monkeypatch):
  """With enable_checkpointing=false there is no save to check the lock before: the metrics rows are checked."""
  from MaxLite import storage
  from MaxLite.training.trainer import train

  server, url = bucket
  monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
  monkeypatch.setattr(run_lock, "STALE_AFTER_S", 0.5)
  config = make_config(*RUN, f"base_output_directory={url}/runs", "run_name=nockpt", "enable_checkpointing=false")
  with pytest.raises(run_lock.LockLostError, match=r"stopping before writing the metrics of step 1\b"):
    with run_lock.hold(config) as guard:
      monkeypatch.setattr(storage, "replace_generation", _silent_bucket)
      time.sleep(run_lock.STALE_AFTER_S)
      train(config, first_devices(1), guard=guard)
  assert server.objects("locks", "runs/nockpt/") == []
