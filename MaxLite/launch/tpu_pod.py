"""What multihost_runner.py and multihost_job.py share: flag checks, packing the code, calling gcloud."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import tarfile
import tempfile
from collections.abc import Sequence

from MaxLite import storage
from MaxLite.cli.errors import LaunchError

REPO_ROOT = storage.bundled_root()  # the code a launch packs by default: this checkout
TPU = ("gcloud", "compute", "tpus")
# Names go into remote shell commands, file paths and GCP resource names. Besides the safe alphabet, a
# leading letter or digit keeps them from reading as an option ("-rf") or a parent directory ("..").
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# Left out of the code package: run outputs, git history, libtpu (.deps), builds and virtual environments can
# be gigabytes, and bytecode is rebuilt anyway.
_SKIP_TOP = {"outputs", ".deps", "build"}
_SKIP_ANYWHERE = {".git", "__pycache__", ".pytest_cache", ".ruff_cache"}
# Before a command, free the TPU: stop whatever still holds its devices (an earlier run that did not exit) and
# remove libtpu's lock file, as MaxText's runner does; without this the new run fails to open the TPU.
FREE_TPU = (
  'S=$(command -v sudo); for dev in /dev/accel* /dev/vfio/[0-9]*; do [ -e "$dev" ] && $S lsof -t -w "$dev"; '
  "done 2>/dev/null | sort -u | xargs -r $S kill -9 2>/dev/null; $S rm -f /tmp/libtpu_lockfile; true"
)


def slice_names(prefix: str, num_slices: int) -> list[str]:
  """One slice is <prefix> itself; N slices are <prefix>-<i>: the TPU VMs a queued resource makes with
  --node-id=<prefix>, or with --node-prefix=<prefix> --node-count=N."""
  return [prefix] if num_slices == 1 else [f"{prefix}-{i}" for i in range(num_slices)]


def check_name(flag: str, value: str) -> str:
  if not _NAME.fullmatch(value):
    raise LaunchError(f"{flag}={value!r}: use only letters, digits, '.', '_' and '-', starting with a letter or digit")
  return value


def default_run_name() -> str:
  return datetime.datetime.now().strftime("maxlite-%Y%m%d-%H%M%S")


def work_dir(run_name: str) -> str:
  """Local files of a launch (code package, logs, startup script): <tmp>/<run_name>/."""
  path = os.path.join(tempfile.gettempdir(), run_name)
  os.makedirs(path, exist_ok=True)
  return path


def run_gcloud(argv: Sequence[str], capture: bool = False) -> subprocess.CompletedProcess:
  try:
    return subprocess.run(list(argv), capture_output=capture, text=True, check=False, stdin=subprocess.DEVNULL)
  except FileNotFoundError:
    raise LaunchError(
      "gcloud is not on PATH; install the Google Cloud CLI: https://cloud.google.com/sdk/docs/install"
    ) from None


def last_line(text: str) -> str:
  lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
  return lines[-1] if lines else "(no output)"


def gcloud_default(key: str, flag: str) -> str:
  """`gcloud config get <key>` (project, compute/zone) for a flag left empty, as MaxText's scripts do."""
  proc = run_gcloud(["gcloud", "config", "get", key], capture=True)
  value = last_line(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else ""
  if not value or value == "(unset)":
    raise LaunchError(
      f"{flag} is not given and `gcloud config get {key}` is unset; "
      f"pass {flag}=... or run `gcloud config set {key} ...`"
    )
  return value


def pack_code(script_dir: str, tar_path: str) -> str:
  """script_dir's files as a tar.gz at tar_path, without outputs/, .deps/, build/, virtual environments, .git,
  caches and *.egg-info; prints what it packed; returns tar_path."""
  if not os.path.isdir(script_dir):
    raise LaunchError(f"--SCRIPT_DIR={script_dir!r} is not a directory")
  own = os.path.relpath(os.path.abspath(tar_path), os.path.abspath(script_dir))
  packed = {"files": 0, "bytes": 0}

  def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    parts = info.name.split("/")[1:]  # names start with "./"
    if (parts and parts[0] in _SKIP_TOP) or _SKIP_ANYWHERE.intersection(parts) or "/".join(parts) == own:
      return None
    if any(p.endswith(".egg-info") for p in parts):
      return None
    if info.isdir() and os.path.isfile(os.path.join(script_dir, *parts, "pyvenv.cfg")):
      return None  # a virtual environment
    if info.isfile():
      packed["files"] += 1
      packed["bytes"] += info.size
    return info

  with tarfile.open(tar_path, "w:gz") as tar:
    tar.add(script_dir, arcname=".", filter=keep)
  print(
    f"packed {script_dir}: {packed['files']} files, {packed['bytes'] / 2**20:.1f} MiB "
    f"({os.path.getsize(tar_path) / 2**20:.1f} MiB compressed; left out: outputs/, .deps/, build/, "
    "virtual environments, .git, caches)",
    flush=True,
  )
  return tar_path
