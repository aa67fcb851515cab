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
import shutil
import sys

from MaxLite.cli.errors import ConfigError
from MaxLite.runtime.distributed import tpu_chips_present


def _installed(*modules: str) -> bool:
  return any(importlib.util.find_spec(m) is not None for m in modules)


def check(device: str, tpu_present: bool, gpu_present: bool) -> str:
  """A one-line summary of a usable install, or ConfigError saying what is wrong and what to do."""
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
    if not _installed("jax_cuda12_plugin", "jax_plugins.xla_cuda12"):
      raise ConfigError(f"DEVICE=gpu but jax {version} has no CUDA plugin; re-run setup.sh")
    if not gpu_present:
      raise ConfigError("DEVICE=gpu but this machine has no NVIDIA GPU (no /dev/nvidia0); use DEVICE=cpu here")
  elif device != "cpu":
    raise ConfigError(f"DEVICE={device} is not one of cpu, tpu, gpu")
  return f"MaxLite set-up done: jax {version} for DEVICE={device}"


def main() -> int:
  device = os.environ.get("DEVICE", "cpu")
  gpu_present = bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None
  try:
    print(check(device, tpu_chips_present(), gpu_present))
  except ConfigError as e:
    print(f"error: setup.sh: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
