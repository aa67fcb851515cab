"""Join the multi-controller JAX runtime (jax.distributed) when the config asks for it."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Mapping

import jax
from absl import logging

from MaxLite.errors import ConfigError

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
  print(f"error: jax.distributed: not all {raw['num_processes'] if raw['num_processes'] != -1 else ''} processes "
        f"joined coordinator {address} within jax_distributed_initialization_timeout="
        f"{raw['jax_distributed_initialization_timeout']}s (this is process_id={raw['process_id']}); check that "
        "every process was started, with the same coordinator_address and num_processes, and that process 0 is "
        "reachable", file=sys.stderr, flush=True)
  os._exit(2)  # the main thread is blocked inside the runtime; nothing else can end the process cleanly


def initialize(raw: Mapping[str, Any]) -> None:
  """Must run before anything touches jax devices. A no-op with skip_jax_distributed_system=true."""
  if raw["skip_jax_distributed_system"]:
    return
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
  logging.info("jax.distributed: process %d of %d, local devices %s", jax.process_index(), jax.process_count(),
               [str(d) for d in jax.local_devices()])
