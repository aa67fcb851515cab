"""Checks before the first step that this process is the job it thinks it is.

A pod job fails late and obscurely when one host runs a CPU-only jax, sees fewer chips, or was started
with a different command; each of these stops here, on every process, with one line.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np

from MaxLite.cli.errors import ConfigError
from MaxLite.config import Config
from MaxLite.runtime import distributed

# Keys that legitimately differ between the processes of one job: process_id, and which keys were set explicitly
# (steps=200 typed on one host and left at its default on another is the same run).
_PER_PROCESS_KEYS = ("process_id", "explicit_keys")


def check_tpu_support(environ: Mapping[str, str], tpu_present: bool) -> None:
  """Before jax starts: a TPU VM needs a jax that can drive TPUs (never a silent CPU run)."""
  if not tpu_present or environ.get("JAX_PLATFORMS", "").strip() == "cpu":
    return
  if importlib.util.find_spec("libtpu") is None:
    raise ConfigError(
      "this machine has TPU chips but jax has no TPU support installed (no libtpu); "
      "run `bash setup.sh DEVICE=tpu`, or set JAX_PLATFORMS=cpu to run on the CPU on purpose"
    )


def check_backend(environ: Mapping[str, str], tpu_present: bool, backend: str) -> None:
  """After jax starts: on a TPU VM jax must have opened the TPU (it falls back to CPU when it cannot)."""
  if tpu_present and backend == "cpu" and environ.get("JAX_PLATFORMS", "").strip() != "cpu":
    raise ConfigError(
      "this machine has TPU chips but jax is running on the CPU: another process may hold the TPU "
      "(`sudo lsof -w /dev/accel* /dev/vfio/*`), or libtpu failed to load (see the log above); "
      "set JAX_PLATFORMS=cpu to run on the CPU on purpose"
    )


def check_devices(devices_per_process: Mapping[int, int], expected_processes: int) -> None:
  """Every process sees the same number of devices, and as many processes joined as configured."""
  if expected_processes != -1 and len(devices_per_process) != expected_processes:
    raise ConfigError(f"num_processes={expected_processes} but {len(devices_per_process)} processes joined")
  counts = sorted(set(devices_per_process.values()))
  if len(counts) > 1:
    detail = ", ".join(f"process {p}: {n}" for p, n in sorted(devices_per_process.items()))
    raise ConfigError(f"processes see different numbers of devices ({detail}); every host must see all its chips")


def config_digest(values: Mapping[str, Any]) -> bytes:
  comparable = {k: v for k, v in values.items() if k not in _PER_PROCESS_KEYS}
  return hashlib.sha256(json.dumps(comparable, sort_keys=True, default=str).encode()).digest()[:16]


def differing_keys(mine: Mapping[str, Any], reference: Mapping[str, Any]) -> list[str]:
  keys = sorted((set(mine) | set(reference)) - set(_PER_PROCESS_KEYS))
  return [k for k in keys if json.dumps(mine.get(k), default=str) != json.dumps(reference.get(k), default=str)]


def check_same_config(config: Config) -> None:
  """Every process runs the config of process 0; otherwise all stop with one line naming the differences."""
  import jax
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    return
  values = config.to_dict()
  digests = np.asarray(multihost_utils.process_allgather(np.frombuffer(config_digest(values), np.uint8)))
  odd = [p for p in range(len(digests)) if not np.array_equal(digests[p], digests[0])]
  if not odd:
    return
  client = distributed.coordination_client()
  if jax.process_index() == 0:
    client.key_value_set("maxlite/config_of_process_0", json.dumps(values))
  if jax.process_index() in odd:
    reference = json.loads(client.blocking_key_value_get("maxlite/config_of_process_0", 60_000))
    diff = differing_keys(values, reference)
    shown = ", ".join(f"{k}={values.get(k)!r} (process 0: {reference.get(k)!r})" for k in diff[:5])
    raise ConfigError(
      f"this process was started with a different config than process 0: {shown}; "
      "every process of a job must run the same command"
    )
  raise ConfigError(
    f"process(es) {', '.join(map(str, odd))} were started with a different config than process 0 "
    "(their logs name the keys); every process of a job must run the same command"
  )


def run_all(config: Config, tpu_present: bool) -> None:
  import jax

  check_backend(os.environ, tpu_present, jax.default_backend())
  check_devices(Counter(d.process_index for d in jax.devices()), config.num_processes)
  check_same_config(config)
