"""multihost_runner.py and multihost_job.py up to the gcloud boundary: a fake `gcloud` first on PATH records
every call (one JSON line each), describes 2-worker v5p-16 slices and can make one worker fail.
No jax here: these run the real entry points as subprocesses."""

import json
import os
import shlex
import stat
import subprocess
import sys
import tarfile
import time
import types
from pathlib import Path

import pytest
from support import config as support_config

from MaxLite.launch import tpu_pod
from MaxLite.launch import tpu_runner as multihost_runner

REPO = Path(support_config.REPO)
RUNNER = str(REPO / "MaxLite" / "multihost_runner.py")
JOB = str(REPO / "MaxLite" / "multihost_job.py")
WHERE = ["--zone=us-east5-a", "--project=proj"]

FAKE_GCLOUD = r'''#!{python}
"""Fake gcloud. Slice i (name ending in -i, else 0) has workers 10.0.i.2 and 10.0.i.3.
FAKE_GCLOUD_FAIL=S:K makes ssh to slice S worker K exit 3; FAKE_GCLOUD_SSH_SECONDS delays the others."""
import json, os, shutil, sys, tarfile, time

argv = sys.argv[1:]
record = {{"argv": ["gcloud", *argv]}}
for a in argv:
  if a.endswith(".tar.gz") and os.path.isfile(a):
    record["tar_members"] = sorted(tarfile.open(a).getnames())
  if a.startswith("--metadata-from-file=startup-script="):
    record["startup_script"] = open(a.split("=", 2)[2]).read()
with open(os.environ["FAKE_GCLOUD_RECORD"], "a") as f:
  f.write(json.dumps(record) + "\n")

words = [a for a in argv if not a.startswith("-")]
flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)

def slice_index(name):
  tail = name.rsplit("-", 1)[-1]
  return int(tail) if "-" in name and tail.isdigit() else 0

def in_bucket(url):
  return os.path.join(os.environ["FAKE_BUCKET"], url[len("gs://"):])

if words[:2] == ["config", "get"]:
  print({{"project": "fake-project", "compute/zone": "fake-zone"}}[words[2]])
elif words[:4] == ["compute", "tpus", "tpu-vm", "describe"]:
  name = words[4]
  if name.startswith("missing"):
    sys.exit("ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: Resource not found")
  i = slice_index(name)
  print(json.dumps({{"name": "projects/proj/locations/us-east5-a/nodes/" + name, "acceleratorType": "v5p-16",
                    "state": "READY", "networkEndpoints": [
                        {{"ipAddress": f"10.0.{{i}}.{{k + 2}}", "port": 8470,
                          "accessConfig": {{"externalIp": f"34.1.{{i}}.{{k + 2}}"}}}} for k in range(2)]}}))
elif words[:4] == ["compute", "tpus", "tpu-vm", "ssh"]:
  name, worker = words[4], flags["worker"]
  if os.environ.get("FAKE_GCLOUD_FAIL") == f"{{slice_index(name)}}:{{worker}}":
    print("Traceback: worker crashed")
    sys.exit(3)
  if worker != "all":  # a command of one worker takes this long; the runner's stop on --worker=all does not
    time.sleep(float(os.environ.get("FAKE_GCLOUD_SSH_SECONDS", "0")))
  print(f"ran on {{name}} worker {{worker}}")
elif words[:2] == ["storage", "ls"]:
  folder = in_bucket(words[2])
  for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
    print(words[2].rstrip("/") + "/" + name)
elif words[:2] == ["storage", "cp"]:
  src, dst = words[2], words[3]
  if src.startswith("gs://"):
    if not os.path.exists(in_bucket(src)):
      sys.exit("ERROR: not found: " + src)
    shutil.copy(in_bucket(src), dst)
  else:
    target = in_bucket(dst)
    if dst.endswith("/"):
      target = os.path.join(target, os.path.basename(src))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copy(src, target)
'''

FAKE_CURL = """#!/bin/bash
case "$*" in
  *worker-network-endpoints*) printf "%s" "$FAKE_ENDPOINTS" ;;
  *) printf "%s\\n" "$FAKE_TPU_ENV" ;;
esac
"""


def _executable(path: Path, text: str) -> None:
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake(tmp_path):
  bin_dir, tmp = tmp_path / "bin", tmp_path / "tmp"
  bin_dir.mkdir()
  tmp.mkdir()
  _executable(bin_dir / "gcloud", FAKE_GCLOUD.format(python=sys.executable))
  _executable(bin_dir / "curl", FAKE_CURL)
  record = tmp_path / "calls.jsonl"
  env = dict(
    os.environ,
    PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    FAKE_GCLOUD_RECORD=str(record),
    FAKE_BUCKET=str(tmp_path / "bucket"),
    TMPDIR=str(tmp),
  )
  env.pop("FAKE_GCLOUD_FAIL", None)

  def calls():
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

  def run(script, *args, **extra_env):
    return subprocess.run(
      [sys.executable, script, *args],
      env=dict(env, **extra_env),
      cwd=tmp_path,
      capture_output=True,
      text=True,
      timeout=60,
    )

  return types.SimpleNamespace(root=tmp_path, tmp=tmp, env=env, calls=calls, run=run)


@pytest.fixture
def code_dir(tmp_path):
  """A small stand-in for the repo: what is packed, and what is left out."""
  root = tmp_path / "code"
  files = {
    "MaxLite/train.py": "import sys\nprint('fake train', sys.argv[1:])\n",
    "configs/base.yml": "steps: 1\n",
    "outputs/old/metrics.jsonl": "{}\n",
    ".git/HEAD": "ref\n",
    "MaxLite/__pycache__/train.pyc": "x",
  }
  for name, text in files.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text)
  return root


PACKED = [".", "./MaxLite", "./MaxLite/train.py", "./configs", "./configs/base.yml"]


def _ssh_calls(calls):
  """(slice name, worker) -> argv of every `tpu-vm ssh`."""
  return {(c["argv"][5], c["argv"][6]): c["argv"] for c in calls if c["argv"][3:5] == ["tpu-vm", "ssh"]}


def test_runner_two_slices_exact_command_lines(fake, code_dir):
  command = "python3 MaxLite/train.py configs/base.yml run_name=r1 dcn_data_parallelism=2"
  proc = fake.run(
    RUNNER,
    "--TPU_PREFIX=pod",
    f"--COMMAND={command}",
    "--PROJECT=proj",
    "--ZONE=us-east5-a",
    f"--SCRIPT_DIR={code_dir}",
    "--RUN_NAME=r1",
    "--NUM_SLICES=2",
  )
  assert proc.returncode == 0, proc.stderr
  calls = fake.calls()
  tar = str(fake.tmp / "r1" / "maxlite-r1.tar.gz")
  tpu_vm = ["gcloud", "compute", "tpus", "tpu-vm"]

  assert [c["argv"] for c in calls[:2]] == [[*tpu_vm, "describe", f"pod-{i}", *WHERE, "--format=json"] for i in (0, 1)]
  scps = calls[2:4]
  assert sorted(c["argv"] for c in scps) == [
    [*tpu_vm, "scp", tar, f"pod-{i}:~/", "--worker=all", *WHERE, "--strict-host-key-checking=no"] for i in (0, 1)
  ]
  assert all(c["tar_members"] == PACKED for c in scps)

  ssh = _ssh_calls(calls[4:])
  assert len(calls) == 8 and len(ssh) == 4
  for s in (0, 1):
    for k in (0, 1):
      remote = (
        "mkdir -p r1 && tar -xzf maxlite-r1.tar.gz -C r1 && rm -f maxlite-r1.tar.gz && cd r1 && "
        f"{{ {tpu_pod.FREE_TPU}; }} && "
        f"{{ MEGASCALE_COORDINATOR_ADDRESS=10.0.0.2:8081 MEGASCALE_NUM_SLICES=2 MEGASCALE_SLICE_ID={s} "
        f"MEGASCALE_PORT=8081 setsid bash -c '{command}' & echo $! > .maxlite_command.pid; wait $!; }}"
      )
      assert ssh[(f"pod-{s}", f"--worker={k}")] == [
        *tpu_vm,
        "ssh",
        f"pod-{s}",
        f"--worker={k}",
        *WHERE,
        "--strict-host-key-checking=no",
        f"--command={remote}",
      ]
      log = fake.tmp / "r1" / f"slice_{s}_worker_{k}.log"
      assert log.read_text() == f"ran on pod-{s} worker {k}\n"
  assert "finished on all 4 workers" in proc.stdout


def test_runner_one_slice_existing_folder_internal_ip_gcloud_defaults(fake):
  proc = fake.run(
    RUNNER,
    "--TPU_PREFIX=my-tpu",
    "--COMMAND=DEVICE=tpu bash setup.sh",
    "--RUN_NAME=r2",
    "--USE_EXISTING_FOLDER",
    "--INTERNAL_IP=true",
  )
  assert proc.returncode == 0, proc.stderr
  argvs = [c["argv"] for c in fake.calls()]
  where = ["--zone=fake-zone", "--project=fake-project"]
  assert argvs[:3] == [
    ["gcloud", "config", "get", "project"],
    ["gcloud", "config", "get", "compute/zone"],
    ["gcloud", "compute", "tpus", "tpu-vm", "describe", "my-tpu", *where, "--format=json"],
  ]
  assert sorted(argvs[3:]) == [  # no scp, no MEGASCALE_* on one slice
    [
      "gcloud",
      "compute",
      "tpus",
      "tpu-vm",
      "ssh",
      "my-tpu",
      f"--worker={k}",
      *where,
      "--strict-host-key-checking=no",
      "--internal-ip",
      f"--command=cd r2 && {{ {tpu_pod.FREE_TPU}; }} && "
      "{ setsid bash -c 'DEVICE=tpu bash setup.sh' & echo $! > .maxlite_command.pid; wait $!; }",
    ]
    for k in (0, 1)
  ]


def test_runner_failing_worker_is_named_and_stops_the_others(fake, code_dir):
  start = time.monotonic()
  proc = fake.run(
    RUNNER,
    "--TPU_PREFIX=pod",
    "--COMMAND=python3 MaxLite/train.py",
    "--PROJECT=proj",
    "--ZONE=us-east5-a",
    f"--SCRIPT_DIR={code_dir}",
    "--RUN_NAME=r3",
    "--NUM_SLICES=2",
    FAKE_GCLOUD_FAIL="1:1",
    FAKE_GCLOUD_SSH_SECONDS="60",
  )
  assert proc.returncode == 3, proc.stderr
  assert time.monotonic() - start < 30  # the other three were stopped, not waited for
  assert "failed on slice 1 worker 1 with exit code 3" in proc.stderr
  assert "| Traceback: worker crashed" in proc.stderr
  assert (
    "failed: slice 1 worker 1 (exit 3); stopped: slice 0 worker 0, slice 0 worker 1, slice 1 worker 0" in proc.stderr
  )
  # Stopping the local ssh is not enough: the command is ended on every worker of every slice.
  stops = [c["argv"] for c in fake.calls() if "--worker=all" in c["argv"] and c["argv"][4] == "ssh"]
  assert sorted(s[5] for s in stops) == ["pod-0", "pod-1"]
  assert all(s[-1] == f"--command={multihost_runner.stop_command('r3')}" for s in stops)
  assert "stopping the command on the other workers" in proc.stderr


def test_runner_command_is_one_quoted_argument(fake, code_dir):
  evil = "echo hi; rm -rf / $(whoami)"
  proc = fake.run(
    RUNNER,
    "--TPU_PREFIX=pod",
    f"--COMMAND={evil}",
    "--PROJECT=proj",
    "--ZONE=us-east5-a",
    f"--SCRIPT_DIR={code_dir}",
    "--RUN_NAME=r4",
    "--NUM_SLICES=2",
  )
  assert proc.returncode == 0, proc.stderr
  for (name, _), argv in _ssh_calls(fake.calls()).items():
    assert argv[-1].startswith("--command=")
    # What the remote shell parses: its own steps, then the whole command as one word for `bash -c`.
    assert shlex.split(argv[-1][len("--command=") :]) == [
      "mkdir",
      "-p",
      "r4",
      "&&",
      "tar",
      "-xzf",
      "maxlite-r4.tar.gz",
      "-C",
      "r4",
      "&&",
      "rm",
      "-f",
      "maxlite-r4.tar.gz",
      "&&",
      "cd",
      "r4",
      "&&",
      *shlex.split(f"{{ {tpu_pod.FREE_TPU}; }}"),
      "&&",
      "{",
      "MEGASCALE_COORDINATOR_ADDRESS=10.0.0.2:8081",
      "MEGASCALE_NUM_SLICES=2",
      f"MEGASCALE_SLICE_ID={name[-1]}",
      "MEGASCALE_PORT=8081",
      "setsid",
      "bash",
      "-c",
      evil,
      "&",
      "echo",
      "$!",
      ">",
      ".maxlite_command.pid;",
      "wait",
      "$!;",
      "}",
    ]


def test_remote_command_runs_as_one_unit_in_the_run_folder(tmp_path, code_dir):
  """The remote line itself, run by a local bash: every part of COMMAND sees the env and the run folder."""
  home = tmp_path / "home"
  home.mkdir()
  tpu_pod.pack_code(str(code_dir), str(home / "maxlite-r5.tar.gz"))
  command = 'echo "slice $MEGASCALE_SLICE_ID" > a.txt; echo "it\'s $PWD" > b.txt'
  env = multihost_runner.megascale_env(1, 2, "10.0.0.2", 8081)
  remote = multihost_runner.remote_command("r5", "maxlite-r5.tar.gz", command, env, use_existing_folder=False)
  subprocess.run(["bash", "-c", remote], cwd=home, check=True, timeout=30)
  run_dir = home / "r5"
  assert (run_dir / "a.txt").read_text() == "slice 1\n"
  assert (run_dir / "b.txt").read_text() == f"it's {run_dir}\n"
  assert (run_dir / "MaxLite" / "train.py").exists() and not (home / "maxlite-r5.tar.gz").exists()


@pytest.mark.parametrize(
  "script, args",
  [
    (RUNNER, ["--TPU_PREFIX=pod", "--RUN_NAME=x;rm"]),
    (RUNNER, ["--TPU_PREFIX=pod", "--RUN_NAME=.."]),
    (RUNNER, ["--TPU_PREFIX=-rf", "--RUN_NAME=r6"]),
    (RUNNER, ["--TPU_PREFIX=pod $(id)", "--RUN_NAME=r6"]),
    (JOB, ["--RUN_NAME=x;rm", "--TPU_TYPE=v5p-16", "--BUCKET_NAME=gs://bkt"]),
    (JOB, ["--RUN_NAME=j", "--TPU_TYPE=v5p-16;ls", "--BUCKET_NAME=gs://bkt"]),
    (JOB, ["--RUN_NAME=j", "--TPU_TYPE=v5p-16", "--BUCKET_NAME=gs://bkt;ls"]),
  ],
)
def test_bad_names_are_one_error_line(fake, script, args):
  proc = fake.run(script, *args, "--COMMAND=echo hi", "--PROJECT=proj", "--ZONE=us-east5-a")
  assert proc.returncode == 2
  assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
  assert fake.calls() == []


def test_runner_unknown_slice_is_one_error_line(fake):
  proc = fake.run(RUNNER, "--TPU_PREFIX=missing", "--COMMAND=echo hi", "--PROJECT=proj", "--ZONE=us-east5-a")
  assert proc.returncode == 2
  assert proc.stderr == (
    "error: cannot describe TPU missing in zone us-east5-a, project proj: "
    "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: Resource not found\n"
  )


def _run_startup_script(fake, script: str, tpu_env: str, endpoints: str = "10.0.0.2,10.0.0.3") -> Path:
  """Runs a startup script as a worker would, with /opt/maxlite moved under tmp; returns the VM's job root."""
  vm = fake.root / "vm"
  path = fake.root / "startup.sh"
  path.write_text(script.replace("/opt/maxlite/", f"{vm}/"))
  env = dict(fake.env, FAKE_TPU_ENV=tpu_env, FAKE_ENDPOINTS=endpoints)
  subprocess.run(["bash", str(path)], env=env, check=True, timeout=60, capture_output=True)
  return vm


def test_job_two_slices_exact_command_lines_and_startup_script(fake, code_dir):
  command = "python3 MaxLite/train.py configs/base.yml run_name=job1 dcn_data_parallelism=2"
  proc = fake.run(
    JOB,
    "--RUN_NAME=job1",
    "--TPU_TYPE=v5p-16",
    "--NUM_SLICES=2",
    "--BUCKET_NAME=gs://bkt",
    f"--COMMAND={command}",
    "--PROJECT=proj",
    "--ZONE=us-east5-a",
    f"--SCRIPT_DIR={code_dir}",
    "--CQR_EXTRA_ARGS=--reserved",
  )
  assert proc.returncode == 0, proc.stderr
  upload, create = fake.calls()
  local = fake.tmp / "job1"
  assert upload["argv"] == [
    "gcloud",
    "storage",
    "cp",
    str(local / "maxlite-job1.tar.gz"),
    "gs://bkt/job1/maxlite-job1.tar.gz",
  ]
  assert upload["tar_members"] == PACKED
  assert create["argv"] == [
    "gcloud",
    "compute",
    "tpus",
    "queued-resources",
    "create",
    "job1",
    "--accelerator-type=v5p-16",
    "--runtime-version=v2-alpha-tpuv5",
    *WHERE,
    "--node-prefix=job1",
    "--node-count=2",
    "--reserved",
    f"--metadata-from-file=startup-script={local / 'startup-script.sh'}",
  ]
  script = create["startup_script"]
  assert script.startswith("#!/bin/bash\n")
  for line in [
    "    gcloud storage cp gs://bkt/job1/maxlite-job1.tar.gz code.tar.gz && break",
    f"  tar -xzf code.tar.gz -C code && cd code && bash -c '{command}'",
    ') >> "$log" 2>&1',
    'gcloud storage cp "$log" gs://bkt/job1/logs/',
  ]:
    assert line in script.splitlines(), line
  assert (
    "gcloud compute tpus queued-resources delete job1 --zone=us-east5-a --project=proj --force --async" in proc.stdout
  )

  # Worker 1 of slice 1 boots: downloads the code from the (fake) bucket, runs the command, uploads its log.
  vm = _run_startup_script(fake, script, "ACCELERATOR_TYPE: 'v5p-16'\nMEGASCALE_SLICE_ID: '1'\nWORKER_ID: '1'")
  assert (vm / "job1" / "code" / "MaxLite" / "train.py").exists()
  log = (fake.root / "bucket" / "bkt" / "job1" / "logs" / "slice_1_worker_1.log").read_text()
  assert "fake train ['configs/base.yml', 'run_name=job1', 'dcn_data_parallelism=2']" in log
  assert "command exited with status 0" in log
  deletes = lambda: [c["argv"] for c in fake.calls() if c["argv"][3:5] == ["queued-resources", "delete"]]
  assert deletes() == []  # only slice 0 worker 0 deletes

  # Slice 0 worker 0 ends last (2 slices x 2 workers, 3 logs already uploaded): it deletes the TPUs.
  for name in ("slice_0_worker_1.log", "slice_1_worker_0.log"):
    (fake.root / "bucket" / "bkt" / "job1" / "logs" / name).write_text("done\n")
  _run_startup_script(fake, script, "ACCELERATOR_TYPE: 'v5p-16'\nMEGASCALE_SLICE_ID: '0'\nWORKER_ID: '0'")
  assert deletes() == [
    ["gcloud", "compute", "tpus", "queued-resources", "delete", "job1", *WHERE, "--force", "--async", "--quiet"]
  ]
  assert "the TPUs are deleted when the command has ended on every worker" in proc.stdout


def test_job_one_slice_autocheckpoint_and_failing_command(fake, code_dir):
  proc = fake.run(
    JOB,
    "--RUN_NAME=job2",
    "--TPU_TYPE=v6e-8",
    "--BUCKET_NAME=bkt/team",
    "--COMMAND=echo bye; exit 7",
    f"--SCRIPT_DIR={code_dir}",
    "--ENABLE_AUTOCHECKPOINT",
    "--DELETE_ON_EXIT=false",
  )
  assert proc.returncode == 0, proc.stderr
  assert "WARNING: --DELETE_ON_EXIT=false: the TPUs keep running (and billing)" in proc.stdout
  calls = fake.calls()
  assert [c["argv"][:3] for c in calls[:2]] == [["gcloud", "config", "get"]] * 2
  upload, create = calls[2:]
  assert upload["argv"][-1] == "gs://bkt/team/job2/maxlite-job2.tar.gz"
  assert create["argv"] == [
    "gcloud",
    "alpha",
    "compute",
    "tpus",
    "queued-resources",
    "create",
    "job2",
    "--accelerator-type=v6e-8",
    "--runtime-version=v2-alpha-tpuv6e",
    "--zone=fake-zone",
    "--project=fake-project",
    "--node-id=job2",
    "--autocheckpoint-enabled",
    f"--metadata-from-file=startup-script={fake.tmp / 'job2' / 'startup-script.sh'}",
  ]
  _run_startup_script(fake, create["startup_script"], "ACCELERATOR_TYPE: 'v6e-8'\nWORKER_ID: '0'")
  log = (fake.root / "bucket" / "bkt" / "team" / "job2" / "logs" / "slice_0_worker_0.log").read_text()
  assert "bye\n" in log and "command exited with status 7" in log
  assert "queued-resources delete" not in create["startup_script"]
  assert not [c for c in fake.calls() if "delete" in c["argv"]]


def test_pack_code_leaves_out_outputs_git_bytecode_libtpu_and_venvs(tmp_path, code_dir, capsys):
  for name in (
    ".deps/libtpu/libtpu.so",
    "venv/pyvenv.cfg",
    "venv/lib/big.so",
    "maxlite.egg-info/PKG-INFO",
    "build/lib/x.py",
    "MaxLite/data/.pytest_cache/x",
  ):
    (code_dir / name).parent.mkdir(parents=True, exist_ok=True)
    (code_dir / name).write_text("x" * 1000)
  tar = tpu_pod.pack_code(str(code_dir), str(code_dir / "self.tar.gz"))  # its own file is left out too
  assert sorted(tarfile.open(tar).getnames()) == [*PACKED[:2], "./MaxLite/data", *PACKED[2:]]
  assert f"packed {code_dir}: 2 files, 0.0 MiB" in capsys.readouterr().out
