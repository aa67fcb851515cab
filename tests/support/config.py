"""The repo's paths, configs of the simulated devices, the train.py command and ArrayRecord contents: what most test
files use. Imported after tests/conftest.py has set the XLA flags and the 8 simulated CPU devices."""

import os
import subprocess
import sys

import jax

from MaxLite.config import load_config
from support.fast_compile import FAST_COMPILE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE_YML = os.path.join(REPO, "configs", "base.yml")
# What every tiny in-process run starts from (each file adds what its tests are about: data, steps, learning rate,
# checkpoints): the tiny model on 64-token rows, no tensorboard files. eval_interval=-1 turns eval off; the tests that
# evaluate set it.
TINY = ("model_name=tiny", "max_target_length=64", "enable_tensorboard=false")


def make_config(*overrides: str, num_devices: int = 1):
  """Config for `num_devices` of the simulated devices (one process, one slice); overrides are key=value."""
  return load_config([BASE_YML, *overrides], num_devices=num_devices, num_slices=1, process_count=1)


def derived_keys(*overrides: str, platform: str = "cpu", num_devices: int = 1) -> dict:
  """The tiny model's keys, validated and derived as on `platform` (the attention kernel a config gets, and why)."""
  from MaxLite import config as config_lib
  from MaxLite.config import validation

  raw = config_lib.load_raw([BASE_YML, "model_name=tiny", *overrides])
  return validation.validate_and_derive(raw, num_devices=num_devices, num_slices=1, process_count=1, platform=platform)


def first_devices(n: int):
  return jax.devices()[:n]


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
