"""Several real processes joined by jax.distributed (gloo), started by MaxLite/launch_local.py."""

import json
import os
import re
import shutil
import signal
import sys
import time

import numpy as np
import procs
import pytest

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out

TINY = (
  *procs.TINY,
  "enable_tensorboard=false",
  "dataset_type=grain",
  "per_device_batch_size=1",
  "ici_fsdp_parallelism=8",
  "steps=8",
)

# 2 processes x 2 devices, for the SIGTERM test: what it checks is between the processes (it sets its own steps).
TWO_BY_TWO = (*TINY[:-2], "ici_fsdp_parallelism=4")


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


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
  """A folder for the module's shared runs; each runs once, whichever test asks first, and only if one does."""
  return tmp_path_factory.mktemp("shared")


CHECKPOINTED = (*TINY, "run_name=b", "enable_checkpointing=true", "checkpoint_period=3")


@pytest.fixture(scope="module")
def killed(shared):
  """A 2 x 4 run saving every 3 steps, SIGKILLed (launcher and both processes) after step 4, with a copy of its run
  directory as the kill left it and its losses so far (uninterrupted up to the kill). Both resumes of it (as 2 x 4,
  and as 1 process on another mesh) first put that copy back (`_as_killed`), so each resumes the very files of the one
  killed launch, at the same path."""
  base, log = shared / "killed", str(shared / "killed.log")
  command = procs.launch_command(2, 4, *CHECKPOINTED, f"base_output_directory={base}")
  metrics = str(base / "b" / "metrics.jsonl")
  launcher = procs.start(command, log)
  procs.wait_for_step(launcher, metrics, 4, log)
  procs.kill_group(launcher, signal.SIGKILL)  # the launcher and both training processes
  _assert_all_exit(f"base_output_directory={base}")
  assert sorted(os.listdir(base / "b" / "checkpoints"))[0] == "3"
  shutil.copytree(base / "b", shared / "killed_copy", symlinks=True)
  before = procs.losses(procs.metric_rows(metrics))
  return {"run_dir": base / "b", "copy": shared / "killed_copy", "command": command, "log": log, "before": before}


def _as_killed(killed) -> str:
  """Puts the killed run directory back as the kill left it; its metrics file."""
  shutil.rmtree(killed["run_dir"])
  shutil.copytree(killed["copy"], killed["run_dir"], symlinks=True)
  return str(killed["run_dir"] / "metrics.jsonl")


@pytest.fixture(scope="module")
def resumed(killed):
  """{step: loss} of the steps the killed 2 x 4 run ran again when resumed as 2 x 4 (the same command) to step 8."""
  metrics = _as_killed(killed)
  assert procs.run(killed["command"], killed["log"]) == 0, procs.tail(killed["log"])
  return procs.losses(procs.resumed_rows(metrics, killed["log"]))


def _uninterrupted(killed, resumed) -> dict[int, float]:
  """The 2 x 4 run's losses, steps 1-8: the killed run's up to the kill, then the resumed run's."""
  return {**killed["before"], **resumed}


def test_two_processes_killed_and_resumed_match_uninterrupted_run(killed, resumed):
  """The steps after the checkpoint the resume starts from ran twice, before the kill and after it: bit for bit."""
  before = killed["before"]
  assert max(resumed) == 8 and min(resumed) in (4, 7) and max(before) >= 4
  replayed = range(min(resumed), max(before) + 1)
  assert replayed and {s: resumed[s] for s in replayed} == {s: before[s] for s in replayed}  # bit for bit
  assert sorted(os.listdir(killed["run_dir"] / "checkpoints" / "8" / "data_iter")) == [
    "commit_success.txt",
    "process_0-of-2.json",
    "process_1-of-2.json",
  ]


def test_sigterm_to_the_job_saves_the_same_step_on_every_process(tmp_path):
  """jax.distributed's preemption sync: both processes agree on the step, save it, exit 0 (2 processes x 2 devices:
  what is tested is between the processes)."""
  args = (
    *TWO_BY_TWO,
    "steps=100000",
    f"base_output_directory={tmp_path}",
    "run_name=p",
    "enable_checkpointing=true",
    "checkpoint_period=100000",
  )
  metrics, log = str(tmp_path / "p" / "metrics.jsonl"), str(tmp_path / "launch.log")
  launcher = procs.start(procs.launch_command(2, 2, *args), log)
  procs.wait_for_step(launcher, metrics, 3, log)
  launcher.send_signal(signal.SIGTERM)  # the launcher forwards it to both processes
  assert launcher.wait(timeout=120) == 0, procs.tail(log)
  with open(log, encoding="utf-8") as f:
    saved = sorted(re.findall(r"\[p(\d)\] .*preempted: saved a checkpoint at step (\d+)", f.read()))
  assert [p for p, _ in saved] == ["0", "1"] and saved[0][1] == saved[1][1], saved
  assert os.listdir(tmp_path / "p" / "checkpoints") == [saved[0][1]]


def _assert_all_exit(text: str, within: float = 10) -> None:
  """No process whose command line mentions `text` is left after `within` seconds."""
  deadline = time.monotonic() + within
  while _processes_mentioning(text) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not _processes_mentioning(text)


def _pid_of(*fragments: str) -> int:
  for pid in _processes_mentioning(fragments[0]):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      argv = f.read().split(b"\0")
    if all(x.encode() in argv for x in fragments) and any(a.endswith(b"train.py") for a in argv):
      return pid
  raise AssertionError(f"no train.py process with {fragments}")


def test_a_crashed_process_fails_the_launch_fast_and_leaves_no_orphans(tmp_path):
  # Under a full CI load the SIGKILLed process can take seconds to be reaped after its peer exited on the lost
  # connection; launch_local waits for it (test_the_killed_process_is_named_even_when_its_peer_exits_first).
  args = (*TINY[:-1], "steps=100000", f"base_output_directory={tmp_path}", "run_name=c")
  log = str(tmp_path / "launch.log")
  launcher = procs.start(procs.launch_command(2, 4, *args), log)
  procs.wait_for_step(launcher, str(tmp_path / "c" / "metrics.jsonl"), 2, log)
  os.kill(_pid_of(f"base_output_directory={tmp_path}", "process_id=1"), signal.SIGKILL)
  crashed_at = time.monotonic()
  code = launcher.wait(timeout=60)
  assert code != 0 and time.monotonic() - crashed_at < 60
  # the whole log: the peer's traceback, forwarded after the report, can be longer than any fixed tail
  output = procs.tail(log, lines=100_000)
  assert "launch_local: process 1 exited with code -9; last lines of" in output
  assert re.search(r"  \| .*step +\d+/\d+ \| loss", output)  # the crashed process's own last log lines
  _assert_all_exit(f"base_output_directory={tmp_path}")


def test_unreachable_coordinator_is_one_clear_line_within_the_timeout(tmp_path):
  log = str(tmp_path / "log")
  start = time.monotonic()
  code = procs.run(
    procs.train_command(
      "model_name=tiny",
      "skip_jax_distributed_system=false",
      "coordinator_address=127.0.0.1:9",
      "num_processes=2",
      "process_id=1",
      "jax_distributed_initialization_timeout=5",
      f"base_output_directory={tmp_path}",
    ),
    log,
    timeout=60,
  )
  assert code == 2 and time.monotonic() - start < 30
  output = procs.tail(log, lines=3)
  assert (
    "Traceback" not in output
    and "error: jax.distributed: not all 2 processes joined coordinator 127.0.0.1:9 "
    "within jax_distributed_initialization_timeout=5s (this is process_id=1)"
    in output
  ), output


def test_grain_data_is_the_same_on_any_process_layout_and_resumes_on_another(tmp_path, killed, resumed):
  """Shipped corpus, fsdp=8: 1 process x 8 devices, 2 x 4 and 4 x 2 train on the same global batches; a 2-process
  run killed after step 4 resumes as 1 process on another mesh (fsdp=4 x tensor=2) and continues the same stream.
  Processes with other device counts round differently in XLA's CPU code, hence rel 1e-5, not bit for bit.
  The 2 x 4 run is the module's killed one and its resume (see `killed` and `resumed`)."""
  args = (*TINY, f"base_output_directory={tmp_path}")
  log = str(tmp_path / "log")
  assert procs.run(procs.train_command(*args, "run_name=one"), log, devices=8) == 0, procs.tail(log)
  assert procs.run(procs.launch_command(4, 2, *args, "run_name=four"), log) == 0, procs.tail(log)
  one, four = (procs.losses(procs.metric_rows(str(tmp_path / r / "metrics.jsonl"))) for r in ("one", "four"))
  two = _uninterrupted(killed, resumed)
  assert sorted(one) == list(range(1, 9))
  np.testing.assert_allclose([two[s] for s in one], list(one.values()), rtol=1e-5)
  np.testing.assert_allclose([four[s] for s in one], list(one.values()), rtol=1e-5)

  # The killed 2 x 4 run, resumed as 1 process x 8 devices on another mesh.
  metrics = _as_killed(killed)
  checkpointed = (*CHECKPOINTED, f"base_output_directory={killed['run_dir'].parent}")
  other_mesh = procs.train_command(*checkpointed, "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
  assert procs.run(other_mesh, log, devices=8) == 0, procs.tail(log)
  resumed = procs.losses(procs.resumed_rows(metrics, log))
  assert resumed and min(resumed) in (4, 7) and max(resumed) == 8
  np.testing.assert_allclose([resumed[s] for s in sorted(resumed)], [one[s] for s in sorted(resumed)], rtol=1e-5)


def test_any_device_order_feeds_each_process_its_own_rows(tmp_path):
  """A mesh whose hosts alternate along the batch (v5p-32 and larger) trains like the contiguous one."""
  from MaxLite.launch.local import free_port

  worker = os.path.join(procs.REPO, "end_to_end", "device_order_worker.py")
  args = (*TINY[:-1], "steps=4", "run_name=r", "enable_checkpointing=false", "jax_cache_dir=")
  for order in ("contiguous", "interleaved"):
    port, log = free_port(), str(tmp_path / f"{order}.log")
    out = [f"base_output_directory={tmp_path / order}"]
    workers = [
      procs.start([sys.executable, worker, order, str(port), str(i), str(tmp_path), *args, *out], log, devices=4)
      for i in range(2)
    ]
    assert [w.wait(timeout=300) for w in workers] == [0, 0], procs.tail(log, lines=40)
  fed = {
    (o, i): json.loads((tmp_path / f"rows_{o}_{i}.json").read_text())
    for o in ("contiguous", "interleaved")
    for i in (0, 1)
  }
  assert fed["contiguous", 0] == {"rows": [0, 1, 2, 3]}
  assert fed["interleaved", 0] == {"rows": [0, 1, 4, 5]}
  assert fed["interleaved", 1] == {"rows": [2, 3, 6, 7]}
  contiguous, interleaved = (
    json.loads((tmp_path / f"losses_{o}.json").read_text()) for o in ("contiguous", "interleaved")
  )
  assert len(contiguous) == 4
  # The same rows on other devices: the same batch, summed in another order.
  np.testing.assert_allclose(interleaved, contiguous, rtol=1e-5)


def test_a_worker_started_with_another_command_stops_the_job_with_one_line(tmp_path):
  from MaxLite.launch.local import free_port

  port = free_port()
  common = (
    *TINY,
    f"base_output_directory={tmp_path}",
    "run_name=m",
    "skip_jax_distributed_system=false",
    f"coordinator_address=127.0.0.1:{port}",
    "num_processes=2",
    "jax_cache_dir=",
  )
  logs = [str(tmp_path / f"p{i}.log") for i in range(2)]
  workers = [
    procs.start(procs.train_command(*common, "process_id=0"), logs[0], devices=4),
    procs.start(procs.train_command(*common, "process_id=1", "steps=5"), logs[1], devices=4),
  ]
  assert [w.wait(timeout=300) for w in workers] == [2, 2], procs.tail(logs[1], lines=40)
  errors = [[line for line in procs.tail(log, lines=200).splitlines() if line.startswith("error:")] for log in logs]
  assert len(errors[0]) == 1 and "process(es) 1 were started with a different config than process 0" in errors[0][0]
  assert len(errors[1]) == 1 and "steps=5 (process 0: 8)" in errors[1][0], errors[1]
  assert not os.path.exists(tmp_path / "m" / "metrics.jsonl")


def test_the_killed_process_is_named_even_when_its_peer_exits_first(tmp_path):
  """A killed process is reaped late on a loaded machine (CI once took over 2 s); its peer's ordinary failure on the
  lost connection must not be reported as the cause. Here the peer fails at once and the killed one dies 3 s later."""
  from MaxLite.launch import local

  peer = local._Worker(0, [sys.executable, "-c", "import sys; sys.exit(1)"], dict(os.environ), str(tmp_path / "0.log"))
  killed = local._Worker(1, ["sh", "-c", "sleep 3; kill -9 $$"], dict(os.environ), str(tmp_path / "1.log"))
  peer.proc.wait()
  assert local._first_cause([peer, killed], [peer]) is killed and killed.proc.returncode == -9
