r"""Start a job on new TPU slices through a queued resource, as MaxText's multihost_job.py does.

Usage:   python3 MaxLite/multihost_job.py --TPU_TYPE=TYPE --BUCKET_NAME=gs://... --COMMAND="..." [flags]
         (or: maxlite-tpu-job ...)
Example:
  python3 MaxLite/multihost_job.py --RUN_NAME=my-job --TPU_TYPE=v5p-16 --NUM_SLICES=2 --BUCKET_NAME=gs://my-bucket \
    --COMMAND="... && python3 MaxLite/train.py configs/base.yml ..."

Packs --SCRIPT_DIR (default: this repo; without outputs/, .git, __pycache__) and uploads it to
gs://<bucket>/<RUN_NAME>/, then asks for the TPUs with `gcloud compute tpus queued-resources create`, passing a
startup script. When the TPUs come up, every worker of every slice downloads the code, runs --COMMAND in it
with its output in a log file, and uploads the log to gs://<bucket>/<RUN_NAME>/logs/. The script returns once
the request is accepted and prints how to watch and delete the job; the TPUs run until you delete it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from collections.abc import Sequence

from MaxLite import cli
from MaxLite.cli.errors import LaunchError
from MaxLite.launch import tpu_pod

# Runtime (OS image) versions Cloud TPU documents for JAX, by TPU generation.
RUNTIME_VERSIONS = {
  "v6e": "v2-alpha-tpuv6e",
  "v5p": "v2-alpha-tpuv5",
  "v5litepod": "v2-alpha-tpuv5-lite",
  "v5e": "v2-alpha-tpuv5-lite",
  "v4": "tpu-ubuntu2204-base",
  "v3": "tpu-ubuntu2204-base",
  "v2": "tpu-ubuntu2204-base",
}
JOB_ROOT = "/opt/maxlite"  # on the workers: <JOB_ROOT>/<RUN_NAME>/code/ and the logs
TPU_ENV_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/tpu-env"
# The slice's workers, comma-separated (what jax.distributed reads too).
ENDPOINTS_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/worker-network-endpoints"
# How long slice 0 worker 0 waits for the other workers' logs before deleting the TPUs anyway.
DELETE_WAIT_S = 900
_TPU_TYPE = re.compile(r"v[0-9]+[a-z]*-[0-9]+")
_BUCKET = re.compile(r"(?:gs://)?([a-z0-9][a-z0-9._-]*[a-z0-9](?:/[A-Za-z0-9._-]+)*)/?")


def default_runtime_version(tpu_type: str) -> str:
  generation = tpu_type.rsplit("-", 1)[0]
  if generation not in RUNTIME_VERSIONS:
    raise LaunchError(
      f"no default runtime version for --TPU_TYPE={tpu_type}; pass --VERSION=... "
      "(see `gcloud compute tpus tpu-vm versions list`)"
    )
  return RUNTIME_VERSIONS[generation]


def bucket_url(value: str) -> str:
  """gs://bucket[/folder] from --BUCKET_NAME given with or without gs://, without a trailing slash."""
  match = _BUCKET.fullmatch(value)
  if not match:
    raise LaunchError(f"--BUCKET_NAME={value!r} is not a bucket name or gs://bucket[/folder] path")
  return f"gs://{match.group(1)}"


def storage_cp_command(source: str, destination: str) -> list[str]:
  return ["gcloud", "storage", "cp", source, destination]


def create_command(
  run_name: str,
  tpu_type: str,
  version: str,
  num_slices: int,
  zone: str,
  project: str,
  startup_script_path: str,
  extra_args: Sequence[str] = (),
  autocheckpoint: bool = False,
) -> list[str]:
  # --autocheckpoint-enabled exists only in gcloud's alpha track.
  gcloud = ["gcloud", "alpha", "compute", "tpus"] if autocheckpoint else list(tpu_pod.TPU)
  nodes = [f"--node-id={run_name}"] if num_slices == 1 else [f"--node-prefix={run_name}", f"--node-count={num_slices}"]
  return [
    *gcloud,
    "queued-resources",
    "create",
    run_name,
    f"--accelerator-type={tpu_type}",
    f"--runtime-version={version}",
    f"--zone={zone}",
    f"--project={project}",
    *nodes,
    *extra_args,
    *(["--autocheckpoint-enabled"] if autocheckpoint else []),
    f"--metadata-from-file=startup-script={startup_script_path}",
  ]


def delete_command(run_name: str, zone: str, project: str) -> list[str]:
  return [
    *tpu_pod.TPU,
    "queued-resources",
    "delete",
    run_name,
    f"--zone={zone}",
    f"--project={project}",
    "--force",
    "--async",
    "--quiet",
  ]


def startup_script(
  run_name: str, code_url: str, logs_url: str, command: str, delete: list[str] | None = None, num_slices: int = 1
) -> str:
  """What every worker runs as root at boot: fetch the code, run `command` in it into a log, upload the log;
  with `delete`, slice 0 worker 0 then deletes the queued resource once every worker's log is uploaded."""
  q = shlex.quote
  job_dir = q(f"{JOB_ROOT}/{run_name}")
  return f"""#!/bin/bash
# MaxLite job {run_name}, written by multihost_job.py. The TPU VMs run this as root at every boot, on every
# worker of every slice, so after a maintenance reboot the command starts again.
export HOME="${{HOME:-/root}}"
# Which worker this is, from the TPU VM's metadata (lines like WORKER_ID: '1'); one slice has no MEGASCALE_SLICE_ID.
tpu_env=$(curl -s -H 'Metadata-Flavor: Google' {TPU_ENV_URL})
tpu_env_value() {{ printf '%s\\n' "$tpu_env" | grep "^$1:" | cut -d "'" -f 2; }}
WORKER_ID=$(tpu_env_value WORKER_ID)
SLICE_ID=$(tpu_env_value MEGASCALE_SLICE_ID)
SLICE_ID=${{SLICE_ID:-0}}
mkdir -p {job_dir}/code && cd {job_dir} || exit 1
log="$PWD/slice_${{SLICE_ID}}_worker_${{WORKER_ID}}.log"
(
  echo "multihost_job: {run_name}: slice $SLICE_ID worker $WORKER_ID starting at $(date -u)"
  # A VM's network can lag at boot: retry the download for a few minutes.
  for attempt in 1 2 3 4 5 6 7 8 9 10; do
    gcloud storage cp {q(code_url)} code.tar.gz && break
    sleep 30
  done
  # Unpacked over the previous boot's copy, so run outputs under code/ survive a reboot.
  tar -xzf code.tar.gz -C code && cd code && bash -c {q(command)}
) >> "$log" 2>&1
status=$?
echo "multihost_job: {run_name}: command exited with status $status at $(date -u)" >> "$log"
gcloud storage cp "$log" {q(logs_url)}
""" + (_delete_block(delete, logs_url, num_slices) if delete else "")


def _delete_block(delete: list[str], logs_url: str, num_slices: int) -> str:
  """The one-off job ends its own TPUs: they bill until the queued resource is deleted."""
  polls = DELETE_WAIT_S // 10
  return f"""if [ "$SLICE_ID" = 0 ] && [ "$WORKER_ID" = 0 ]; then
  workers=$(curl -s -H 'Metadata-Flavor: Google' {ENDPOINTS_URL} | tr ',' '\n' | grep -c .)
  expected=$((${{workers:-1}} * {num_slices}))
  for poll in $(seq {polls}); do
    [ "$(gcloud storage ls {shlex.quote(logs_url)} 2>/dev/null | grep -c '[.]log$')" -ge "$expected" ] && break
    sleep 10
  done
  echo "multihost_job: deleting the queued resource (--DELETE_ON_EXIT) at $(date -u)" >> "$log"
  {shlex.join(delete)} >> "$log" 2>&1
fi
"""


def watch_commands(run_name: str, num_slices: int, zone: str, project: str, logs_url: str) -> list[str]:
  where = [f"--zone={zone}", f"--project={project}"]
  qr = [*tpu_pod.TPU, "queued-resources"]
  tail = f"--command=tail -f {JOB_ROOT}/{run_name}/slice_0_worker_0.log"
  ssh = [*tpu_pod.TPU, "tpu-vm", "ssh", tpu_pod.slice_names(run_name, num_slices)[0], "--worker=0", *where, tail]
  return [
    f"state:   {shlex.join([*qr, 'describe', run_name, *where])}",
    f"live:    {shlex.join(ssh)}",
    f"logs:    {shlex.join(['gcloud', 'storage', 'ls', logs_url])}   (each worker's, when its command ends)",
    f"delete:  {shlex.join([*qr, 'delete', run_name, *where, '--force', '--async'])}   (the TPUs run until then)",
  ]


def parse_args(argv: Sequence[str], doc: str = __doc__) -> argparse.Namespace:
  parser = cli.FlagParser(doc)
  parser.add_argument("--TPU_TYPE", required=True, help="accelerator type of one slice, e.g. v5p-16, v6e-8")
  parser.add_argument("--NUM_SLICES", type=int, default=1)
  parser.add_argument("--BUCKET_NAME", required=True, help="gs://bucket[/folder] for the code and the logs")
  parser.add_argument("--COMMAND", required=True, help="shell command every worker runs in the code folder")
  parser.add_argument("--RUN_NAME", default="", help="queued resource and TPU VM name (default: timestamp)")
  parser.add_argument("--PROJECT", default="", help="default: gcloud config get project")
  parser.add_argument("--ZONE", default="", help="default: gcloud config get compute/zone")
  parser.add_argument("--VERSION", default="", help="TPU runtime version (default: the documented one for TPU_TYPE)")
  parser.add_argument("--SCRIPT_DIR", default=tpu_pod.REPO_ROOT, help="directory to run the command in (this repo)")
  parser.add_argument("--CQR_EXTRA_ARGS", default="", help="more queued-resources create flags, e.g. '--reserved'")
  cli.add_bool_flag(parser, "--ENABLE_AUTOCHECKPOINT", "--autocheckpoint-enabled (gcloud alpha)")
  parser.add_argument(
    "--DELETE_ON_EXIT",
    nargs="?",
    const="true",
    default="true",
    choices=("true", "false"),
    help="when the command has ended on every worker, delete the queued resource so the TPUs stop billing "
    "(default true; the TPU VMs' service account needs permission to delete TPUs)",
  )
  args = parser.parse_args(argv)
  args.RUN_NAME = tpu_pod.check_name("--RUN_NAME", args.RUN_NAME or tpu_pod.default_run_name())
  if not _TPU_TYPE.fullmatch(args.TPU_TYPE):
    raise LaunchError(f"--TPU_TYPE={args.TPU_TYPE!r} is not an accelerator type like v5p-16")
  if args.NUM_SLICES < 1:
    raise LaunchError(f"--NUM_SLICES must be at least 1, got {args.NUM_SLICES}")
  if not args.COMMAND.strip():
    raise LaunchError("--COMMAND is empty")
  try:
    args.CQR_EXTRA_ARGS = shlex.split(args.CQR_EXTRA_ARGS)
  except ValueError as e:
    raise LaunchError(f"--CQR_EXTRA_ARGS: {e}") from None
  return args


def run(argv: Sequence[str], doc: str = __doc__) -> int:
  args = parse_args(argv, doc)
  bucket = bucket_url(args.BUCKET_NAME)
  version = args.VERSION or default_runtime_version(args.TPU_TYPE)
  project = args.PROJECT or tpu_pod.gcloud_default("project", "--PROJECT")
  zone = args.ZONE or tpu_pod.gcloud_default("compute/zone", "--ZONE")
  run = args.RUN_NAME
  local_dir = tpu_pod.work_dir(run)
  code_url, logs_url = f"{bucket}/{run}/maxlite-{run}.tar.gz", f"{bucket}/{run}/logs/"

  tar_path = tpu_pod.pack_code(args.SCRIPT_DIR, os.path.join(local_dir, f"maxlite-{run}.tar.gz"))
  print(f"multihost_job: uploading {args.SCRIPT_DIR} to {code_url}", flush=True)
  if tpu_pod.run_gcloud(storage_cp_command(tar_path, code_url)).returncode != 0:
    raise LaunchError(
      f"uploading the code to {code_url} failed (gcloud's message is above); "
      "check the bucket name and `gcloud auth login`"
    )

  script_path = os.path.join(local_dir, "startup-script.sh")
  with open(script_path, "w", encoding="utf-8") as f:
    delete = delete_command(run, zone, project) if args.DELETE_ON_EXIT == "true" else None
    f.write(startup_script(run, code_url, logs_url, args.COMMAND, delete, args.NUM_SLICES))
  create = create_command(
    run,
    args.TPU_TYPE,
    version,
    args.NUM_SLICES,
    zone,
    project,
    script_path,
    args.CQR_EXTRA_ARGS,
    args.ENABLE_AUTOCHECKPOINT,
  )
  print(f"multihost_job: requesting {args.NUM_SLICES} x {args.TPU_TYPE} as queued resource {run}", flush=True)
  if tpu_pod.run_gcloud(create).returncode != 0:
    raise LaunchError(f"creating queued resource {run} failed (gcloud's message is above)")

  print(f"multihost_job: requested; every worker runs the command once its slice is up. Startup script: {script_path}")
  for line in watch_commands(run, args.NUM_SLICES, zone, project, logs_url):
    print(f"  {line}")
  if args.DELETE_ON_EXIT == "true":
    print("multihost_job: the TPUs are deleted when the command has ended on every worker (--DELETE_ON_EXIT)")
  else:
    print(
      f"multihost_job: WARNING: --DELETE_ON_EXIT=false: the TPUs keep running (and billing) after the command "
      f"ends, until you delete queued resource {run} (the delete command above)"
    )
  return 0
