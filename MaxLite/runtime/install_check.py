"""After setup.sh: is the installed jax able to drive the DEVICE asked for? Never starts a jax runtime.

  DEVICE=tpu python -m MaxLite.runtime.install_check

Starting the runtime would take the TPU chips (and on a pod worker wait for the other hosts), so this only
looks at what is installed and what hardware the machine has. Exit 0 with a summary line, or 2 with one
`error:` line.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys

from MaxLite.cli.errors import ConfigError
from MaxLite.runtime.distributed import tpu_chips_present


def _installed(*modules: str) -> bool:
  def found(module: str) -> bool:
    try:
      return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose package is absent
      return False

  return any(found(m) for m in modules)


def _version(distribution: str) -> str | None:
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def driver_cuda() -> int | None:
  """The newest CUDA major version the NVIDIA driver runs (nvidia-smi's "CUDA Version"), or None."""
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return None
  try:
    out = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
  except (OSError, subprocess.SubprocessError):
    return None
  found = re.search(r"CUDA Version:\s*(\d+)\.", out)
  return int(found.group(1)) if found else None


def _check_cuda_plugin(version: str, driver: int | None) -> str:
  """Which CUDA plugin jax has ("12" or "13"), checked against jaxlib's version and the driver."""
  plugins = [cuda for cuda in ("13", "12") if _installed(f"jax_cuda{cuda}_plugin", f"jax_plugins.xla_cuda{cuda}")]
  if not plugins:
    raise ConfigError(f"DEVICE=gpu but jax {version} has no CUDA plugin (jax-cuda12 or jax-cuda13); re-run setup.sh")
  cuda = plugins[0]
  jaxlib = _version("jaxlib")
  for part in (f"jax-cuda{cuda}-plugin", f"jax-cuda{cuda}-pjrt"):
    installed = _version(part)
    if installed is not None and jaxlib is not None and installed != jaxlib:
      raise ConfigError(
        f"DEVICE=gpu but {part} {installed} does not match jaxlib {jaxlib} (jax loads a plugin of its own version "
        "only); re-run setup.sh"
      )
  if driver is not None and driver < int(cuda):
    raise ConfigError(
      f"DEVICE=gpu: jax's CUDA {cuda} plugin is installed but the NVIDIA driver runs CUDA {driver} at most; "
      f"run `bash setup.sh DEVICE=gpu CUDA={driver}` or update the driver"
    )
  return cuda


def check(device: str, tpu_present: bool, gpu_present: bool, driver: int | None = None) -> str:
  """A one-line summary of a usable install, or ConfigError saying what is wrong and what to do. driver: the CUDA
  major version the NVIDIA driver runs, where known."""
  version = importlib.metadata.version("jax")
  if device == "tpu":
    if not _installed("libtpu"):
      raise ConfigError(f"DEVICE=tpu but jax {version} has no TPU support (libtpu is missing); re-run setup.sh")
    if not tpu_present:
      raise ConfigError(
        "DEVICE=tpu but this machine has no TPU chips (no /dev/accel* or /dev/vfio/*): run it on a TPU VM, "
        "or use DEVICE=cpu here"
      )
  elif device == "gpu":
    cuda = _check_cuda_plugin(version, driver)
    if not gpu_present:
      raise ConfigError("DEVICE=gpu but this machine has no NVIDIA GPU (no /dev/nvidia0); use DEVICE=cpu here")
    return f"MaxLite set-up done: jax {version} with its CUDA {cuda} plugin for DEVICE=gpu"
  elif device != "cpu":
    raise ConfigError(f"DEVICE={device} is not one of cpu, tpu, gpu")
  return f"MaxLite set-up done: jax {version} for DEVICE={device}"


def main() -> int:
  device = os.environ.get("DEVICE", "cpu")
  gpu_present = bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None
  try:
    print(check(device, tpu_chips_present(), gpu_present, driver_cuda() if device == "gpu" else None))
  except ConfigError as e:
    print(f"error: setup.sh: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
