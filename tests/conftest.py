"""Test set-up: 8 simulated CPU devices (must be set before jax is imported anywhere)."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import subprocess
import sys

import jax
import pytest

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
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
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
