"""Run one command on every worker of one or more TPU slices at once, as MaxText's multihost_runner.py does.

Usage:   python3 MaxLite/multihost_runner.py --TPU_PREFIX=NAME --COMMAND="..." [flags]   (or: maxlite-tpu-runner ...)
Example:
  python3 MaxLite/multihost_runner.py --TPU_PREFIX=my-tpu --COMMAND="DEVICE=tpu bash setup.sh"
  python3 MaxLite/multihost_runner.py --TPU_PREFIX=my-tpu --NUM_SLICES=2 --COMMAND="python3 MaxLite/train.py ..."

Run it from your own machine (not a worker). It finds each slice's workers with `gcloud compute tpus tpu-vm
describe`, packs --SCRIPT_DIR (default: this repo; without outputs/, .git, __pycache__), copies the package to
every worker, unpacks it into ~/<RUN_NAME>/ and runs --COMMAND there on all workers in parallel, one
`gcloud ... ssh` each. With --NUM_SLICES=N the slices are <TPU_PREFIX>-0 ... <TPU_PREFIX>-(N-1) and every
command gets MEGASCALE_* variables naming slice 0 worker 0 as the coordinator. Each worker's output goes to
<tmp>/<RUN_NAME>/slice_<i>_worker_<k>.log. If a worker fails, the others are stopped, the failed workers are
named and the exit code is the failed command's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from MaxLite import cli
from MaxLite.cli.errors import LaunchError
from MaxLite.launch import tpu_pod

# The port every worker's TPU runtime uses for traffic between slices. MaxText's runner sets no MEGASCALE_*
# variables (its multislice TPUs come from one queued resource, whose metadata holds them); Ray's TPU
# helpers set these same four for separately created slices, with 8081.
DEFAULT_MEGASCALE_PORT = 8081
TAIL_LINES = 20
STOP_GRACE_S = 5.0
PID_FILE = ".maxlite_command.pid"
POLL_S = 0.2


def describe_command(slice_name: str, zone: str, project: str) -> list[str]:
  return [*tpu_pod.TPU, "tpu-vm", "describe", slice_name, f"--zone={zone}", f"--project={project}", "--format=json"]


def worker_ips(describe_json: str) -> list[str]:
  """Internal IPs of a slice's workers, in worker order, from `describe --format=json`."""
  endpoints = json.loads(describe_json).get("networkEndpoints") or []
  ips = [e.get("ipAddress", "") for e in endpoints]
  if not ips or not all(ips):
    raise ValueError("no networkEndpoints[].ipAddress in the description")
  return ips


def scp_command(tar_path: str, slice_name: str, zone: str, project: str, internal_ip: bool) -> list[str]:
  return [
    *tpu_pod.TPU,
    "tpu-vm",
    "scp",
    tar_path,
    f"{slice_name}:~/",
    "--worker=all",
    f"--zone={zone}",
    f"--project={project}",
    "--strict-host-key-checking=no",
    *(["--internal-ip"] if internal_ip else []),
  ]


def megascale_env(slice_id: int, num_slices: int, coordinator_ip: str, port: int) -> dict[str, str]:
  """What the TPU runtime (and jax.distributed, for process ids) reads to join slices over the data-center network."""
  if num_slices == 1:
    return {}
  return {
    "MEGASCALE_COORDINATOR_ADDRESS": f"{coordinator_ip}:{port}",
    "MEGASCALE_NUM_SLICES": str(num_slices),
    "MEGASCALE_SLICE_ID": str(slice_id),
    "MEGASCALE_PORT": str(port),
  }


def remote_command(
  run_name: str, tar_name: str, command: str, env: Mapping[str, str], use_existing_folder: bool
) -> str:
  """The shell line one worker runs from its home directory: unpack the code, cd into it, run `command`.

  `command` is one quoted argument of `bash -c`, so all of it runs in the run folder with `env`, as one unit:
  a `;` or `$(...)` in it cannot escape into the line around it.
  """
  run_dir, tar = shlex.quote(run_name), shlex.quote(tar_name)
  steps = [] if use_existing_folder else [f"mkdir -p {run_dir}", f"tar -xzf {tar} -C {run_dir}", f"rm -f {tar}"]
  assignments = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
  # Its own session, its id in a file: `stop_command` can end the command and all its children.
  run = " ".join([*assignments, "setsid", "bash", "-c", shlex.quote(command)])
  steps += [f"cd {run_dir}", f"{{ {tpu_pod.FREE_TPU}; }}", f"{{ {run} & echo $! > {PID_FILE}; wait $!; }}"]
  return " && ".join(steps)


def stop_command(run_name: str) -> str:
  """The shell line that ends a worker's command (TERM, then KILL after a grace period) once another failed."""
  pid = f"{shlex.quote(run_name)}/{PID_FILE}"
  return (
    f"[ -f {pid} ] && {{ kill -TERM -- -$(cat {pid}); sleep {int(STOP_GRACE_S)}; kill -KILL -- -$(cat {pid}); }} "
    "2>/dev/null; true"
  )


def worker_ssh_command(
  slice_name: str, worker: int | str, zone: str, project: str, internal_ip: bool, remote: str
) -> list[str]:
  return [
    *tpu_pod.TPU,
    "tpu-vm",
    "ssh",
    slice_name,
    f"--worker={worker}",
    f"--zone={zone}",
    f"--project={project}",
    "--strict-host-key-checking=no",
    *(["--internal-ip"] if internal_ip else []),
    f"--command={remote}",
  ]


@dataclasses.dataclass
class Task:
  label: str
  argv: list[str]
  log_path: str


def _stop(procs: list[subprocess.Popen]) -> None:
  """SIGTERM, then SIGKILL, to each process group: gcloud's ssh/scp children go too."""
  for sig in (signal.SIGTERM, signal.SIGKILL):
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, sig)
        except ProcessLookupError:
          pass
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
      try:
        p.wait(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass


def run_all(tasks: Sequence[Task]) -> list[int | None]:
  """Starts every task at once, each writing to its log; stops the rest as soon as one fails
  (a worker that died leaves the others waiting in collectives forever).

  Returns each task's exit code, None for those stopped here.
  """
  procs: list[subprocess.Popen] = []
  try:
    for t in tasks:
      with open(t.log_path, "w", encoding="utf-8") as log:
        # Own session: a Ctrl-C in this terminal is handled here (stop everything), not by each gcloud.
        procs.append(
          subprocess.Popen(
            t.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
          )
        )
    while True:
      codes = [p.poll() for p in procs]
      if any(c not in (None, 0) for c in codes) or all(c is not None for c in codes):
        return codes
      time.sleep(POLL_S)
  finally:
    _stop(procs)


def _tail(path: str) -> list[str]:
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read().splitlines()[-TAIL_LINES:]


def report(tasks: Sequence[Task], codes: Sequence[int | None], what: str) -> int:
  """Prints the failed tasks (the first with its log's last lines); returns the worst exit code, 0 if none failed."""
  failed = [(t, c) for t, c in zip(tasks, codes) if c not in (None, 0)]
  if not failed:
    return 0
  first, code = failed[0]
  print(
    f"multihost_runner: {what} failed on {first.label} with exit code {code}; last lines of {first.log_path}:",
    file=sys.stderr,
  )
  for line in _tail(first.log_path):
    print(f"  | {line}", file=sys.stderr)
  stopped = [t.label for t, c in zip(tasks, codes) if c is None]
  print(
    f"multihost_runner: failed: {', '.join(f'{t.label} (exit {c})' for t, c in failed)}"
    + (f"; stopped: {', '.join(stopped)}" if stopped else ""),
    file=sys.stderr,
  )
  return max(abs(c) for _, c in failed)


def find_slices(names: Sequence[str], zone: str, project: str) -> list[list[str]]:
  """Each slice's worker IPs; all slices must have the same number of workers."""
  slices = []
  for name in names:
    proc = tpu_pod.run_gcloud(describe_command(name, zone, project), capture=True)
    if proc.returncode != 0:
      raise LaunchError(
        f"cannot describe TPU {name} in zone {zone}, project {project}: {tpu_pod.last_line(proc.stderr)}"
      )
    try:
      slices.append(worker_ips(proc.stdout))
    except ValueError as e:
      raise LaunchError(f"TPU {name}: {e}") from None
  if len({len(ips) for ips in slices}) > 1:
    raise LaunchError(
      "the slices have different worker counts: " + ", ".join(f"{n}: {len(ips)}" for n, ips in zip(names, slices))
    )
  return slices


def parse_args(argv: Sequence[str], doc: str = __doc__) -> argparse.Namespace:
  parser = cli.FlagParser(doc)
  parser.add_argument("--TPU_PREFIX", required=True, help="the slice's name; with --NUM_SLICES=N, <TPU_PREFIX>-<i>")
  parser.add_argument("--COMMAND", required=True, help="shell command run in ~/<RUN_NAME>/ on every worker")
  parser.add_argument("--PROJECT", default="", help="default: gcloud config get project")
  parser.add_argument("--ZONE", default="", help="default: gcloud config get compute/zone")
  parser.add_argument("--SCRIPT_DIR", default=tpu_pod.REPO_ROOT, help="directory copied to the workers (this repo)")
  parser.add_argument("--RUN_NAME", default="", help="folder on the workers and local log folder (default: timestamp)")
  cli.add_bool_flag(parser, "--INTERNAL_IP", "reach the workers by internal IP (when running inside GCP)")
  cli.add_bool_flag(parser, "--USE_EXISTING_FOLDER", "run in ~/<RUN_NAME>/ as it is on the workers; copy nothing")
  parser.add_argument("--NUM_SLICES", type=int, default=1)
  parser.add_argument("--MEGASCALE_PORT", type=int, default=DEFAULT_MEGASCALE_PORT, help="multi-slice only")
  args = parser.parse_args(argv)
  tpu_pod.check_name("--TPU_PREFIX", args.TPU_PREFIX)
  if args.USE_EXISTING_FOLDER and not args.RUN_NAME:
    raise LaunchError("--USE_EXISTING_FOLDER needs the --RUN_NAME of the folder to use")
  args.RUN_NAME = tpu_pod.check_name("--RUN_NAME", args.RUN_NAME or tpu_pod.default_run_name())
  if args.NUM_SLICES < 1:
    raise LaunchError(f"--NUM_SLICES must be at least 1, got {args.NUM_SLICES}")
  if not args.COMMAND.strip():
    raise LaunchError("--COMMAND is empty")
  return args


def run(argv: Sequence[str], doc: str = __doc__) -> int:
  args = parse_args(argv, doc)
  project = args.PROJECT or tpu_pod.gcloud_default("project", "--PROJECT")
  zone = args.ZONE or tpu_pod.gcloud_default("compute/zone", "--ZONE")
  names = tpu_pod.slice_names(args.TPU_PREFIX, args.NUM_SLICES)
  slices = find_slices(names, zone, project)
  local_dir = tpu_pod.work_dir(args.RUN_NAME)
  tar_name = f"maxlite-{args.RUN_NAME}.tar.gz"
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # so run_all's cleanup runs

  if not args.USE_EXISTING_FOLDER:
    tar_path = tpu_pod.pack_code(args.SCRIPT_DIR, os.path.join(local_dir, tar_name))
    print(f"multihost_runner: copying {args.SCRIPT_DIR} to {len(names)} slice(s)", flush=True)
    copies = [
      Task(
        f"slice {i}",
        scp_command(tar_path, name, zone, project, args.INTERNAL_IP),
        os.path.join(local_dir, f"scp_slice_{i}.log"),
      )
      for i, name in enumerate(names)
    ]
    code = report(copies, run_all(copies), "copying the code")
    if code:
      return code

  coordinator = slices[0][0]
  tasks = []
  for i, (name, ips) in enumerate(zip(names, slices)):
    env = megascale_env(i, len(names), coordinator, args.MEGASCALE_PORT)
    remote = remote_command(args.RUN_NAME, tar_name, args.COMMAND, env, args.USE_EXISTING_FOLDER)
    tasks += [
      Task(
        f"slice {i} worker {k}",
        worker_ssh_command(name, k, zone, project, args.INTERNAL_IP, remote),
        os.path.join(local_dir, f"slice_{i}_worker_{k}.log"),
      )
      for k in range(len(ips))
    ]
  print(f"multihost_runner: running on {len(tasks)} workers; logs in {local_dir}/slice_<i>_worker_<k>.log", flush=True)
  codes = run_all(tasks)
  code = report(tasks, codes, "the command")
  if code == 0:
    print(f"multihost_runner: the command finished on all {len(tasks)} workers", flush=True)
  elif None in codes:
    # Stopping the local ssh leaves the remote command running (and holding the TPU): end it there too.
    print("multihost_runner: stopping the command on the other workers", file=sys.stderr, flush=True)
    stops = [
      Task(
        f"slice {i}",
        worker_ssh_command(name, "all", zone, project, args.INTERNAL_IP, stop_command(args.RUN_NAME)),
        os.path.join(local_dir, f"stop_slice_{i}.log"),
      )
      for i, name in enumerate(names)
    ]
    report(stops, run_all(stops), "stopping the command")
  return code
