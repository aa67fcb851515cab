"""What multihost_runner.py and multihost_job.py share: flag checks, packing the code, calling gcloud."""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from typing import Callable, Sequence

from MaxLite.errors import LaunchError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU = ("gcloud", "compute", "tpus")
# Names go into remote shell commands, file paths and GCP resource names. Besides the safe alphabet, a
# leading letter or digit keeps them from reading as an option ("-rf") or a parent directory ("..").
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# Left out of the code package: run outputs and git history can be large, and bytecode is rebuilt anyway.
_SKIP_TOP = {"outputs"}
_SKIP_ANYWHERE = {".git", "__pycache__"}


def check_name(flag: str, value: str) -> str:
  if not _NAME.fullmatch(value):
    raise LaunchError(f"{flag}={value!r}: use only letters, digits, '.', '_' and '-', starting with a letter or digit")
  return value


def str2bool(value: str) -> bool:
  if value.lower() in ("true", "1", "yes"):
    return True
  if value.lower() in ("false", "0", "no"):
    return False
  raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def add_bool_flag(parser: argparse.ArgumentParser, name: str, help_text: str) -> None:
  """`--NAME` alone means true; `--NAME=true|false` is MaxText's spelling."""
  parser.add_argument(name, nargs="?", const=True, default=False, type=str2bool, help=help_text)


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
    raise LaunchError("gcloud is not on PATH; install the Google Cloud CLI: "
                      "https://cloud.google.com/sdk/docs/install") from None


def last_line(text: str) -> str:
  lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
  return lines[-1] if lines else "(no output)"


def gcloud_default(key: str, flag: str) -> str:
  """`gcloud config get <key>` (project, compute/zone) for a flag left empty, as MaxText's scripts do."""
  proc = run_gcloud(["gcloud", "config", "get", key], capture=True)
  value = last_line(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else ""
  if not value or value == "(unset)":
    raise LaunchError(f"{flag} is not given and `gcloud config get {key}` is unset; "
                      f"pass {flag}=... or run `gcloud config set {key} ...`")
  return value


def pack_code(script_dir: str, tar_path: str) -> str:
  """script_dir's files as a tar.gz at tar_path, without outputs/, .git and __pycache__; returns tar_path."""
  if not os.path.isdir(script_dir):
    raise LaunchError(f"--SCRIPT_DIR={script_dir!r} is not a directory")
  own = os.path.relpath(os.path.abspath(tar_path), os.path.abspath(script_dir))

  def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    parts = info.name.split("/")[1:]  # names start with "./"
    if (parts and parts[0] in _SKIP_TOP) or _SKIP_ANYWHERE.intersection(parts) or "/".join(parts) == own:
      return None
    return info

  with tarfile.open(tar_path, "w:gz") as tar:
    tar.add(script_dir, arcname=".", filter=keep)
  return tar_path


def main_wrapper(main: Callable[[Sequence[str]], int]) -> None:
  """Runs `main(sys.argv[1:])`; a LaunchError becomes one `error:` line and exit code 2, Ctrl-C exit code 130."""
  try:
    code = main(sys.argv[1:])
  except LaunchError as e:
    print(f"error: {e}", file=sys.stderr)
    code = 2
  except KeyboardInterrupt:
    code = 130
  sys.exit(code)
