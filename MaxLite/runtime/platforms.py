"""Which platforms jax may use on this machine, decided before jax starts a backend. Imports no jax: the package's
__init__ calls it, before any MaxLite module imports jax."""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Mapping, MutableMapping


def tpu_chips_present() -> bool:
  """This machine has TPU chips (TPU VMs expose them as /dev/accel* or /dev/vfio/<n>), whatever jax sees."""
  return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def accelerator_plugin_installed(environ: Mapping[str, str]) -> bool:
  """A PJRT plugin that jax loads besides its built-in CPU and TPU backends (CUDA, ROCm, ...), found where jax itself
  looks for one."""
  if environ.get("PJRT_NAMES_AND_LIBRARY_PATHS"):
    return True
  if importlib.metadata.entry_points(group="jax_plugins"):
    return True
  return importlib.util.find_spec("jax_plugins") is not None


def cpu_is_all_there_is(environ: Mapping[str, str]) -> bool:
  """Nobody chose a platform (JAX_PLATFORMS) and this machine has nothing but its CPU for jax: no TPU chips, no
  accelerator plugin."""
  return not (environ.get("JAX_PLATFORMS") or tpu_chips_present() or accelerator_plugin_installed(environ))


def use_cpu_when_it_is_all_there_is(environ: MutableMapping[str, str] = os.environ) -> bool:
  """Sets JAX_PLATFORMS=cpu where `cpu_is_all_there_is`; otherwise jax tries libtpu first and logs its failure
  ("Unable to initialize backend 'tpu'") in every command. Returns whether it set it: a TPU or GPU machine, or a
  platform the user chose, is left alone."""
  if not cpu_is_all_there_is(environ):
    return False
  jax = sys.modules.get("jax")
  if jax is not None and jax.config.jax_platforms:  # chosen in code by a program that runs a command in-process
    return False
  environ["JAX_PLATFORMS"] = "cpu"  # for this process's jax and the processes it starts
  if jax is not None:  # jax reads the variable when it is imported
    jax.config.update("jax_platforms", "cpu")
  return True
