"""Test set-up: 8 simulated CPU devices (must be set before jax is imported anywhere)."""

import os

# LLVM's optimisation level 0: the tests' programs are small and run a few steps, so XLA's CPU compiles are most of
# their time, and level 0 compiles them 1.5-2.5x faster. The programs compute the same functions (the equivalence
# tests compare runs that all use it); what users run is compiled at the default level. Processes a test starts on
# one device get FAST_COMPILE alone; those on several devices keep these flags (end_to_end/procs.py).
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import subprocess
import sys

import jax
import pytest

# One compilation cache for every test process of a session (both xdist workers): many tests compile the same small
# programs (a single-device reference step, the same layer under several layouts), and XLA's CPU compiles are a large
# part of the suite's time. Only in these processes: the train.py processes a test starts keep their own settings.
jax.config.update("jax_compilation_cache_dir", os.path.join(os.environ.get("TMPDIR", "/tmp"), "maxlite-test-xla-cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)  # not the many small eager ops
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_compilation_cache_max_size", 2 << 30)  # least recently used entries go first

from MaxLite.config import load_config

BASE_YML = os.path.join(REPO, "configs", "base.yml")


def make_config(*overrides: str, num_devices: int = 1):
  """Config for `num_devices` of the simulated devices (one process, one slice); overrides are key=value."""
  return load_config([BASE_YML, *overrides], num_devices=num_devices, num_slices=1, process_count=1)


def first_devices(n: int):
  return jax.devices()[:n]


@pytest.fixture
def tmp_outputs(tmp_path):
  return f"base_output_directory={tmp_path}"


def run_train_cli(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
  """`python MaxLite/train.py configs/base.yml key=value ...` from the repo root on one CPU device."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
  command = [sys.executable, "MaxLite/train.py", "configs/base.yml", *overrides]
  return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def read_records(paths: list[str]) -> list[str]:
  """The UTF-8 records of ArrayRecord files, files sorted by path (read with the plain reader, not MaxLite's)."""
  from array_record.python.array_record_module import ArrayRecordReader

  out = []
  for path in sorted(paths):
    reader = ArrayRecordReader(path)
    out += [r.decode() for r in reader.read_all()]
    reader.close()
  return out
