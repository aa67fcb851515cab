"""Join the multi-controller JAX runtime (jax.distributed) when the environment has several hosts.

With `skip_jax_distributed_system=false` (MaxText's default) a process joins when it is told where the
coordinator is (`coordinator_address`, JAX_COORDINATOR_ADDRESS), runs as one of several SLURM tasks, or runs
on a TPU VM (jax then reads the slice's hosts from the TPU metadata); elsewhere it stays single-process.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

import jax
from absl import logging

from MaxLite.cli.errors import ConfigError
from MaxLite.config.keys_derived import default_run_name
from MaxLite.runtime.platforms import tpu_chips_present

# JAX's own deadline is set this much later than ours, so our clear message wins the race against
# the runtime's abort (a C++ fatal error that Python cannot catch).
_JAX_DEADLINE_MARGIN_S = 10


def _check(raw: Mapping[str, Any]) -> None:
  n, i = raw["num_processes"], raw["process_id"]
  if n != -1 and n < 1:
    raise ConfigError(f"num_processes must be >= 1 or -1 (auto-detect), got {n}")
  if n != -1 and i != -1 and not 0 <= i < n:
    raise ConfigError(f"process_id={i} must be in [0, num_processes={n})")
  if raw["jax_distributed_initialization_timeout"] <= 0:
    raise ConfigError("jax_distributed_initialization_timeout must be positive (seconds)")


def _give_up(raw: Mapping[str, Any]) -> None:
  address = raw["coordinator_address"] or os.environ.get("JAX_COORDINATOR_ADDRESS", "") or "(auto-detected)"
  print(
    f"error: jax.distributed: not all {raw['num_processes'] if raw['num_processes'] != -1 else ''} processes "
    f"joined coordinator {address} within jax_distributed_initialization_timeout="
    f"{raw['jax_distributed_initialization_timeout']}s (this is process_id={raw['process_id']}); check that "
    "every process was started, with the same coordinator_address and num_processes, and that process 0 is "
    "reachable",
    file=sys.stderr,
    flush=True,
  )
  os._exit(2)  # the main thread is blocked inside the runtime; nothing else can end the process cleanly


def join_reason(raw: Mapping[str, Any], environ: Mapping[str, str], tpu_present: bool) -> str | None:
  """Why this process should join jax.distributed, or None to run single-process."""
  if raw["skip_jax_distributed_system"]:
    return None
  if raw["coordinator_address"]:
    return f"coordinator_address={raw['coordinator_address']}"
  if environ.get("JAX_COORDINATOR_ADDRESS"):
    return f"JAX_COORDINATOR_ADDRESS={environ['JAX_COORDINATOR_ADDRESS']}"
  tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "1"
  if environ.get("SLURM_JOB_ID") and tasks.isdigit() and int(tasks) > 1:
    return f"SLURM job {environ['SLURM_JOB_ID']} with {tasks} tasks"
  if tpu_present:
    return "TPU VM (hosts from the TPU metadata)"
  return None


def initialize(raw: Mapping[str, Any]) -> bool:
  """Joins when `join_reason` says so; returns whether it did. Must run before anything touches jax devices."""
  reason = join_reason(raw, os.environ, tpu_chips_present())
  if reason is None:
    return False
  _check(raw)
  # Only the CPU backend reads this, so it is safe everywhere; asking which backend is in use
  # would initialise it, and jax.distributed.initialize must run before any backend exists.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  timeout = raw["jax_distributed_initialization_timeout"]
  kwargs: dict[str, Any] = {"initialization_timeout": timeout + _JAX_DEADLINE_MARGIN_S}
  if raw["coordinator_address"]:
    kwargs["coordinator_address"] = raw["coordinator_address"]
  if raw["num_processes"] != -1:
    kwargs["num_processes"] = raw["num_processes"]
  if raw["process_id"] != -1:
    kwargs["process_id"] = raw["process_id"]
  watchdog = threading.Timer(timeout, _give_up, args=(raw,))
  watchdog.daemon = True
  watchdog.start()
  try:
    # With no address, jax detects TPU pods, SLURM, GKE/Kubernetes and friends from the environment.
    jax.distributed.initialize(**kwargs)
  finally:
    watchdog.cancel()
  logging.info(
    "jax.distributed (%s): process %d of %d, local devices %s",
    reason,
    jax.process_index(),
    jax.process_count(),
    [str(d) for d in jax.local_devices()],
  )
  return True


def coordination_client() -> Any:
  from jax._src import distributed as jax_distributed  # the coordination service's key-value store

  return jax_distributed.global_state.client


def shared_run_name(raw: dict[str, Any]) -> None:
  """An empty run_name becomes process 0's timestamp name on every process (clocks and start times differ)."""
  if raw["run_name"]:
    return
  key = "maxlite/run_name"
  if jax.process_index() == 0:
    coordination_client().key_value_set(key, default_run_name())
  timeout_ms = 1000 * raw["jax_distributed_initialization_timeout"]
  raw["run_name"] = coordination_client().blocking_key_value_get(key, timeout_ms)
