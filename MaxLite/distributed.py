"""Join the multi-controller JAX runtime (jax.distributed) when the config asks for it."""

from __future__ import annotations

from typing import Any, Mapping

import jax


def initialize(raw_config: Mapping[str, Any]) -> None:
  """Must run before anything touches jax devices. A no-op with skip_jax_distributed_system=true."""
  if raw_config["skip_jax_distributed_system"]:
    return
  # Only the CPU backend reads this, so it is safe everywhere; asking which backend is in use
  # would initialise it, and jax.distributed.initialize must run before any backend exists.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs: dict[str, Any] = {"initialization_timeout": raw_config["jax_distributed_initialization_timeout"]}
  if raw_config["coordinator_address"]:
    kwargs["coordinator_address"] = raw_config["coordinator_address"]
  if raw_config["num_processes"] != -1:
    kwargs["num_processes"] = raw_config["num_processes"]
  if raw_config["process_id"] != -1:
    kwargs["process_id"] = raw_config["process_id"]
  # With no address, jax detects TPU pods, SLURM, GKE/Kubernetes and friends from the environment.
  jax.distributed.initialize(**kwargs)
