"""gs:// everywhere, against a real GCS API on 127.0.0.1 (fake-gcs-server): runs killed and resumed on a
bucket equal uninterrupted local runs bit for bit, with data, tokenizer, outputs and checkpoints in the bucket.

Every compared run is a train.py process seeing the same device count (see test_kill_resume.py).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import procs
import pytest
from gcs import LocalGCS

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out

BUCKET = "maxlite-test"
TINY = (*procs.TINY, "dataset_type=grain")
CORPUS = os.path.join(procs.REPO, "assets", "corpus")
TOKENIZER = os.path.join(procs.REPO, "assets", "tokenizer", "maxlite_sp8k.model")
_LOGGED_STEP = re.compile(r"step\s+(\d+)(?:/\d+)? \| loss")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  with LocalGCS(str(tmp_path_factory.mktemp("gcs"))) as server:
    server.create_bucket(BUCKET)
    for name in sorted(os.listdir(CORPUS)):
      if name.endswith(".array_record"):
        with open(os.path.join(CORPUS, name), "rb") as f:
          server.upload(BUCKET, f"data/{name}", f.read())
    with open(TOKENIZER, "rb") as f:
      server.upload(BUCKET, "data/tokenizer.model", f.read())
    yield server


def _env(gcs, devices=1):
  return dict(procs.env_with_devices(devices), **gcs.env, PYTHONFAULTHANDLER="1")


def _start(gcs, command, log, devices=1):
  return subprocess.Popen(
    command, env=_env(gcs, devices), stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True
  )


def _run(gcs, command, log, devices=1, timeout=300):
  proc = _start(gcs, command, log, devices)
  try:
    return proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    procs.kill_group(proc)
    raise


def _wait(proc, log, condition, what, timeout=300):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if condition():
      return
    if proc.poll() is not None:
      raise AssertionError(f"exited with {proc.returncode} before {what}:\n{procs.tail(log)}")
    time.sleep(0.05)
  os.killpg(proc.pid, signal.SIGABRT)  # PYTHONFAULTHANDLER: every thread's stack goes to the log
  time.sleep(5)
  procs.kill_group(proc)
  raise AssertionError(f"no {what} within {timeout}s:\n{procs.tail(log, lines=80)}")


def _logged_steps(log):
  with open(log, encoding="utf-8", errors="replace") as f:
    return [int(m.group(1)) for m in _LOGGED_STEP.finditer(f.read())]


def _bucket_rows(gcs, run):
  return [json.loads(line) for line in gcs.read(BUCKET, f"runs/{run}/metrics.jsonl").decode().splitlines()]


def _bucket_losses(gcs, run):
  return procs.losses(_bucket_rows(gcs, run))


def _finalized(gcs, run):
  """Steps whose own commit marker exists (each item inside a step has one too, written earlier)."""
  names = gcs.objects(BUCKET, f"runs/{run}/checkpoints/")
  return sorted(
    int(n.split("/")[3]) for n in names if re.fullmatch(r"runs/[^/]+/checkpoints/\d+/commit_success.txt", n)
  )


def _step_dirs(gcs, run):
  return sorted({int(n.split("/")[3]) for n in gcs.objects(BUCKET, f"runs/{run}/checkpoints/")})


@pytest.fixture(scope="module")
def resumed_on_gcs(gcs, tmp_path_factory):
  """A local run (data and outputs on disk) and the same run on the bucket, SIGKILLed after step 6 and relaunched."""
  tmp = tmp_path_factory.mktemp("resume")
  common = (*TINY, "per_device_batch_size=4", "steps=10", "enable_checkpointing=true", "checkpoint_period=4")
  local_log = str(tmp / "local.log")
  local = (*common, f"base_output_directory={tmp}", "run_name=a", "enable_tensorboard=false")
  assert procs.run(procs.train_command(*local), local_log) == 0, procs.tail(local_log)
  remote = (
    *common,
    f"grain_train_files=gs://{BUCKET}/data/train-*.array_record",
    f"tokenizer_path=gs://{BUCKET}/data/tokenizer.model",
    f"base_output_directory=gs://{BUCKET}/runs",
    "run_name=b",
    "enable_tensorboard=true",
  )
  log = str(tmp / "gcs.log")
  proc = _start(gcs, procs.train_command(*remote), log)
  _wait(proc, log, lambda: 4 in _finalized(gcs, "b") and max(_logged_steps(log), default=0) >= 6, "step 4 saved")
  procs.kill_group(proc, signal.SIGKILL)
  assert _run(gcs, procs.train_command(*remote), log) == 0, procs.tail(log)
  return {
    "tmp": tmp,
    "log": log,
    "local": procs.losses(procs.metric_rows(str(tmp / "a" / "metrics.jsonl"))),
    "remote": _bucket_losses(gcs, "b"),
    "remote_steps": [r["step"] for r in _bucket_rows(gcs, "b") if "loss" in r],
  }


def test_killed_run_on_gcs_resumes_to_the_local_losses_bit_for_bit(gcs, resumed_on_gcs):
  with open(resumed_on_gcs["log"], encoding="utf-8") as f:
    assert "resumed from checkpoint at step 4" in f.read()
  assert resumed_on_gcs["remote_steps"] == list(range(1, 11))  # one row per step: the replayed ones replaced
  assert resumed_on_gcs["remote"] == resumed_on_gcs["local"]  # gs:// data + tokenizer == local files, bit for bit
  assert _finalized(gcs, "b") == [4, 8, 10]
  events = [n for n in gcs.objects(BUCKET, "runs/b/tensorboard/") if "tfevents" in n]
  assert events, "no tensorboard event file in the bucket"
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  local_copy = resumed_on_gcs["tmp"] / "events" / os.path.basename(events[-1])
  local_copy.parent.mkdir(exist_ok=True)
  local_copy.write_bytes(gcs.read(BUCKET, events[-1]))
  accumulator = EventAccumulator(str(local_copy.parent))
  accumulator.Reload()
  assert [e.step for e in accumulator.Scalars("learning/loss")][-1] == 10


def test_tools_read_and_write_gs_paths(gcs, resumed_on_gcs):
  tmp = resumed_on_gcs["tmp"]
  step = f"gs://{BUCKET}/runs/b/checkpoints/10"
  info = _run_tool(gcs, tmp, "checkpoint_info.py", f"gs://{BUCKET}/runs/b")
  assert info.returncode == 0, info.stderr
  assert "10" in info.stdout and "params" in info.stdout

  # The bucket's final checkpoint holds the local run's exact weights: both export to the same bytes.
  for source, target in ((step, f"gs://{BUCKET}/hf/b"), (str(tmp / "a" / "checkpoints" / "10"), str(tmp / "hf_a"))):
    out = _run_tool(gcs, tmp, "convert_hf.py", "to_hf", f"--checkpoint_path={source}", f"--output_path={target}")
    assert out.returncode == 0, out.stderr
  assert gcs.read(BUCKET, "hf/b/model.safetensors") == (tmp / "hf_a" / "model.safetensors").read_bytes()
  assert json.loads(gcs.read(BUCKET, "hf/b/config.json")) == json.loads((tmp / "hf_a" / "config.json").read_text())

  compiled = _run_tool(
    gcs,
    tmp,
    "train_compile.py",
    procs.BASE_YML,
    "model_name=tiny",
    "compile_topology=cpu-1",
    f"compiled_trainstep_file=gs://{BUCKET}/compiled/tiny.bin",
  )
  assert compiled.returncode == 0, compiled.stderr[-2000:]
  assert len(gcs.read(BUCKET, "compiled/tiny.bin")) > 1000

  # load_parameters_path from the bucket: step 1 of a new run has the eval loss of the loaded weights.
  log = str(tmp / "load.log")
  finetune = (*TINY, "per_device_batch_size=4", "steps=1", f"base_output_directory={tmp}", "run_name=ft")
  command = procs.train_command(*finetune, f"load_parameters_path={step}", "enable_tensorboard=false")
  assert _run(gcs, command, log) == 0, procs.tail(log)
  local_command = procs.train_command(
    *finetune, "run_name=ft_local", f"load_parameters_path={tmp / 'a' / 'checkpoints' / '10'}"
  )
  assert procs.run(local_command, log) == 0, procs.tail(log)
  loaded = procs.losses(procs.metric_rows(str(tmp / "ft" / "metrics.jsonl")))
  assert loaded == procs.losses(procs.metric_rows(str(tmp / "ft_local" / "metrics.jsonl")))
  assert loaded[1] < resumed_on_gcs["local"][1] - 1.0  # trained weights, not a fresh start


def _run_tool(gcs, tmp, tool, *args):
  return subprocess.run(
    [sys.executable, os.path.join(procs.REPO, "MaxLite", tool), *args],
    env=_env(gcs),
    capture_output=True,
    text=True,
    timeout=300,
    cwd=str(tmp),
  )


def test_a_save_cut_short_on_gcs_is_never_resumed(gcs, tmp_path):
  """Kill while an async save to the bucket is in flight (default 7M model: saves outlast steps)."""
  args = (
    "dataset_type=synthetic",
    "max_target_length=32",
    "per_device_batch_size=1",
    "enable_tensorboard=false",
    "log_period=1",
    "eval_interval=-1",
    "steps=40",
    "enable_checkpointing=true",
    "checkpoint_period=1",
    f"base_output_directory=gs://{BUCKET}/runs",
    "run_name=partial",
  )
  log = str(tmp_path / "partial.log")
  proc = _start(gcs, procs.train_command(*args), log)

  def save_in_flight():
    started, done = _step_dirs(gcs, "partial"), _finalized(gcs, "partial")
    return bool(done) and max(started) > max(done)

  _wait(proc, log, save_in_flight, "save in flight after a finalized one")
  procs.kill_group(proc, signal.SIGKILL)
  done = _finalized(gcs, "partial")
  partial = sorted(set(_step_dirs(gcs, "partial")) - set(done))
  assert partial and max(partial) > max(done)

  info = _run_tool(gcs, tmp_path, "checkpoint_info.py", f"gs://{BUCKET}/runs/partial")
  assert info.returncode == 0, info.stderr
  assert str(max(partial)) in info.stdout  # named as an incomplete save

  assert _run(gcs, procs.train_command(*args, "steps=" + str(max(partial) + 2)), log) == 0, procs.tail(log)
  with open(log, encoding="utf-8") as f:
    assert f"resumed from checkpoint at step {max(done)}" in f.read()
  assert max(partial) + 2 in _finalized(gcs, "partial")


# 2 processes x 4 devices as 2 slices of 4 (one data replica per process): the layout of every 2-process test here.
TWO_PROCESSES = (
  *TINY,
  "enable_tensorboard=false",
  "per_device_batch_size=1",
  "num_slices=2",
  "dcn_data_parallelism=2",
  "ici_fsdp_parallelism=4",
  "steps=16",
)


def test_a_read_fault_seen_by_one_process_resumes_both_from_the_same_step(gcs, tmp_path):
  """Process 1 alone finds step 6 corrupt: both go back to step 3, where each process deciding alone would resume
  them from different steps, and run steps 4 to 6 again with the first run's losses. (A network error on one process
  is retried, tests/checkpoint/test_checkpoint_reads.py; one that outlasts the retries stops both,
  end_to_end/test_emergency_resume.py.)"""
  remote = (*TWO_PROCESSES, f"base_output_directory=gs://{BUCKET}/runs", "run_name=fault", "enable_checkpointing=true")

  def run(steps, fault=None):
    log = str(tmp_path / f"to_{steps}.log")
    env = dict(_env(gcs), **({"MAXLITE_TEST_CHECKPOINT_READ_FAULT": fault} if fault else {}))
    command = procs.launch_command(2, 4, *remote, "checkpoint_period=3", f"steps={steps}")
    proc = subprocess.Popen(command, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
      assert proc.wait(timeout=300) == 0, procs.tail(log)
    except subprocess.TimeoutExpired:
      procs.kill_group(proc)
      raise
    with open(log, encoding="utf-8") as f:
      return f.read()

  run(6)
  uninterrupted = _bucket_losses(gcs, "fault")  # the resume drops the rows after its checkpoint: read them first
  assert sorted(uninterrupted) == list(range(1, 7))
  corrupt = run(7, fault="1:6:corrupt:-1")
  assert re.search(r"skipping checkpoint step 6 on every process, unreadable on process \[1\]", corrupt), corrupt
  assert corrupt.count("resumed from checkpoint at step 3") == 2, corrupt
  losses = _bucket_losses(gcs, "fault")
  assert sorted(losses) == list(range(1, 8)) and {s: losses[s] for s in range(1, 7)} == uninterrupted  # bit for bit
  iterators = [n for n in gcs.objects(BUCKET, "runs/fault/checkpoints/7/data_iter/") if n.endswith(".json")]
  assert [os.path.basename(n) for n in iterators] == ["process_0-of-2.json", "process_1-of-2.json"]


@pytest.mark.parametrize(
  "output, fragment",
  [
    ("gs://no-such-bucket-maxlite/runs", "bucket 'no-such-bucket"),  # the local server has only BUCKET
    ("gs://", "base_output_directory=gs://"),
    ("gs://ab/runs", "not a valid bucket name"),
  ],
)
def test_a_missing_bucket_is_one_line_before_anything_is_written(gcs, tmp_path, output, fragment):
  log = str(tmp_path / "bad.log")
  proc = subprocess.run(
    procs.train_command("dataset_type=synthetic", "steps=1", f"base_output_directory={output}"),
    env=_env(gcs),
    capture_output=True,
    text=True,
    timeout=120,
  )
  del log
  assert proc.returncode == 2, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and fragment in errors[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr


def test_an_unreachable_storage_endpoint_is_one_line(tmp_path):
  env = dict(procs.env_with_devices(1), STORAGE_EMULATOR_HOST="http://127.0.0.1:9")
  start = time.monotonic()
  proc = subprocess.run(
    procs.train_command("dataset_type=synthetic", "steps=1", "base_output_directory=gs://bucket/runs"),
    env=env,
    capture_output=True,
    text=True,
    timeout=180,
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "gs://bucket/runs" in errors[0] and "Traceback" not in proc.stderr
  assert time.monotonic() - start < 120


# Reads every document of the named sources and prints them as one JSON object: {file type: [documents]}.
_READ_SOURCES = """
import json, sys
from MaxLite import storage
from MaxLite.data.sources import open_source
storage.use_storage_emulator_if_set()
out = {}
for kind, files, column in (a.split("|") for a in sys.argv[1:]):
  source = open_source(files, kind, column)
  out[kind] = [source[i] for i in range(len(source))]
print(json.dumps(out))
"""


def test_parquet_and_jsonl_documents_read_from_gcs(gcs, tmp_path):
  """Parquet footers and row groups through a gcsfs file, JSONL lines as ranged reads: the local documents."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  from MaxLite.data.sources import open_source

  eval_file = os.path.join(CORPUS, "eval-00000-of-00001.array_record")
  documents = [open_source(eval_file)[i].decode() for i in range(len(open_source(eval_file)))]
  halves = (documents[:40], documents[40:])
  for k, half in enumerate(halves):
    pq.write_table(pa.table({"body": half}), tmp_path / f"p{k}.parquet", row_group_size=16)
    (tmp_path / f"j{k}.jsonl").write_text("".join(json.dumps({"body": d}) + "\n\n" for d in half))
    for name in (f"p{k}.parquet", f"j{k}.jsonl"):
      gcs.upload(BUCKET, f"mixed/{name}", (tmp_path / name).read_bytes())
  proc = subprocess.run(
    [sys.executable, "-c", _READ_SOURCES, f"parquet|gs://{BUCKET}/mixed/p*.parquet|body"]
    + [f"jsonl|gs://{BUCKET}/mixed/*.jsonl|body"],
    env=_env(gcs),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert json.loads(proc.stdout) == {"parquet": documents, "jsonl": documents}


def test_emulator_endpoints_follow_storage_emulator_host():
  """A process started after another emulator's settings were set must not keep the old endpoints
  (ArrayRecord's client would retry a dead port for many minutes)."""
  from MaxLite import storage

  environ = {
    "STORAGE_EMULATOR_HOST": "http://127.0.0.1:2222",
    "CLOUD_STORAGE_EMULATOR_ENDPOINT": "http://127.0.0.1:1111",
    "TENSORSTORE_GCS_HTTP_URL": "http://127.0.0.1:1111",
    "NO_GCE_CHECK": "false",
  }
  storage.use_storage_emulator_if_set(environ)
  assert environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] == environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:2222"
  assert environ["NO_GCE_CHECK"] == "false"  # an explicit user choice stays


def _local_steps(folder):
  return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []


def _bucket_copy(gcs, prefix):
  return {name: gcs.read(BUCKET, name) for name in gcs.objects(BUCKET, prefix)}


def _put_back(gcs, prefix, objects, folder, copy):
  """The bucket objects under `prefix` and `folder` become exactly `objects` and `copy` again."""
  for name in gcs.objects(BUCKET, prefix):
    gcs.delete(BUCKET, name)
  for name, data in objects.items():
    gcs.upload(BUCKET, name, data)
  assert gcs.objects(BUCKET, prefix) == sorted(objects)
  shutil.rmtree(folder, ignore_errors=True)
  shutil.copytree(copy, folder, symlinks=True)


def test_emergency_checkpoints_resume_from_a_local_step_a_lost_host_or_lost_positions(gcs, tmp_path):
  """2 processes x 4 devices, each process one data replica with its own local directory; persistent steps on
  the bucket. Killed after a local save newer than the persistent one, the job resumes from that local step;
  with process 1's local directory gone (a replaced host), from what is left; with that step's data positions
  gone, from the step before, saving over the leftover local step. Each resume runs the steps after the one it
  resumed from to the end: those the killed job had run too give its losses bit for bit, and the three resumes give
  the same losses as one another.

  The job is killed once: the three resumes each start from the exact files it left (same run_name, same paths;
  local files and bucket objects are copied aside after the kill and put back before each later scenario),
  which spares two launches that only repeated the kill."""
  log = str(tmp_path / "launch.log")
  local = tmp_path / "local"
  run, prefix, local_run = "em", "runs/em/", str(local / "em")
  emergency = (
    *TWO_PROCESSES,
    f"base_output_directory=gs://{BUCKET}/runs",
    "enable_emergency_checkpoint=true",
    f"local_checkpoint_directory={local}",
    "local_checkpoint_period=2",
    "checkpoint_period=8",
    f"run_name={run}",
  )
  command = procs.launch_command(2, 4, *emergency)
  launcher = _start(gcs, command, log)
  replica_1 = os.path.join(local_run, "process_1")

  def saved_and_logged():  # local step 10 saved, and the metrics rows up to it in the bucket (process 0 writes them)
    logged = _bucket_losses(gcs, run) if gcs.objects(BUCKET, f"{prefix}metrics.jsonl") else {}
    return max(_local_steps(replica_1), default=0) >= 10 and max(logged, default=0) >= 10

  _wait(launcher, log, saved_and_logged, "local step 10 saved and logged")
  os.killpg(launcher.pid, signal.SIGSTOP)  # frozen at once: no save after this look
  local_steps, persistent = _local_steps(replica_1), _finalized(gcs, run)
  procs.kill_group(launcher, signal.SIGKILL)
  assert max(local_steps) > max(persistent), (local_steps, persistent)
  killed_objects, killed_local = _bucket_copy(gcs, prefix), str(tmp_path / "killed_local")
  uninterrupted = _bucket_losses(gcs, run)  # the job's losses up to the kill
  assert max(uninterrupted) > max(persistent), (uninterrupted, persistent)  # steps the host-loss resume runs again
  finished = {}
  shutil.copytree(local_run, killed_local, symlinks=True)
  positions = f"{prefix}data_positions/{max(local_steps)}/"
  assert any(name.startswith(positions) for name in killed_objects)  # what the "positions" scenario deletes

  for loss in (None, "host", "positions"):
    if loss is not None:  # the first resume changed both: back to what the kill left
      _put_back(gcs, prefix, killed_objects, local_run, killed_local)
    if loss == "host":
      shutil.rmtree(replica_1)
    if loss == "positions":  # the newest local step is left without them, as a kill between the two saves would
      for name in gcs.objects(BUCKET, positions):
        gcs.delete(BUCKET, name)
    start = len(open(log, encoding="utf-8").read())
    assert _run(gcs, command, log) == 0, procs.tail(log)
    with open(log, encoding="utf-8") as f:
      resumed = f.read()[start:]
    steps = {int(m) for m in re.findall(r"resumed from checkpoint at step (\d+)", resumed)}
    assert resumed.count("resumed from checkpoint at step") == 2 and len(steps) == 1, resumed[-3000:]  # agreed
    if loss is None:
      expected = max(local_steps)
    elif loss == "host":
      expected = max(persistent)
    else:  # the newest local step is unusable: the step before it, local or persistent
      expected = max(s for s in local_steps + persistent if s < max(local_steps))
    assert steps == {expected}, (loss, steps, local_steps, persistent)
    if loss == "positions":  # and process 1 deleted its local step, which the resumed run saved again
      assert f"deleting local step {max(local_steps)}" in resumed, resumed[-3000:]
    finished[loss] = _bucket_losses(gcs, run)
    assert sorted(finished[loss]) == list(range(1, 17)), loss
    assert {s: finished[loss][s] for s in uninterrupted} == uninterrupted, loss  # replayed steps bit for bit
  assert finished[None] == finished["host"] == finished["positions"]
