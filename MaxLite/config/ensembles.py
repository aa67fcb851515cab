"""The ensemble keys: ensemble_size members of one model trained in one program (training/ensemble.py), each with its
own seeds or peak learning rate, sharded over the `ensemble` mesh axis. Pure checks on the raw dict.

A member is a separate run folded into a batch dimension: member i's seeds are init_weights_seed + i and seed + i, or
with ensemble_learning_rates everyone's are the config's, so a learning-rate sweep differs by the rate alone.
"""

from __future__ import annotations

import math
from typing import Any

from MaxLite.cli.errors import ConfigError
from MaxLite.config import objectives

# What one program of K members cannot run yet: each of these shards or transforms the step in a way the member axis
# has not been tested with, so it is refused up front rather than trusted.
_UNSUPPORTED = (
  ("enable_lora", "LoRA"),
  ("quantization", "quantized training"),
  ("parameter_memory_host_offload", "host offload"),
  ("optimizer_memory_host_offload", "host offload"),
  ("enable_emergency_checkpoint", "emergency checkpoints"),
)


def _rate(value: Any) -> float:
  try:  # YAML reads 3e-3 (no dot) as a string
    rate = float(value)
  except (TypeError, ValueError):
    rate = math.nan
  return rate if 0 < rate < math.inf else math.nan


def check(c: dict[str, Any]) -> dict[str, Any]:
  """ensemble_size, ensemble_data, ensemble_learning_rates and ensemble_member on their own (before the mesh); returns
  the learning rates as numbers."""
  size = c["ensemble_size"]  # a positive int and ensemble_data one of its values: their Fields say so (schema.py)
  rates = list(c["ensemble_learning_rates"])
  if rates and size == 1:
    raise ConfigError(
      f"ensemble_learning_rates has {len(rates)} values but ensemble_size=1: set ensemble_size={len(rates)} to sweep "
      "them, or learning_rate for one run"
    )
  if rates and len(rates) != size:
    raise ConfigError(
      f"ensemble_learning_rates has {len(rates)} values for ensemble_size={size}: give one peak rate per member"
    )
  if any(math.isnan(_rate(r)) for r in rates):
    raise ConfigError(f"ensemble_learning_rates={rates} must all be positive numbers")
  rates = [_rate(r) for r in rates]
  # ensemble_member names a member of the step load_parameters_path reads (decode.py, to_hf, a run starting from one
  # member): it is checked against that step's own ensemble_size when the step is read (checkpoint/lora_steps.py).
  member = c["ensemble_member"]
  if member < -1:
    raise ConfigError(f"ensemble_member={member} is out of range: use -1 (none) or a member 0, 1, ...")
  if member != -1 and not c["load_parameters_path"]:
    raise ConfigError(
      f"ensemble_member={member} without load_parameters_path: it picks a member of the ensemble step that "
      "load_parameters_path names"
    )
  # Member i's seeds are the config's + i: JAX keeps 32-bit seeds.
  if size > 1 and not rates and max(c["init_weights_seed"], c["seed"]) + size > 2**31:
    raise ConfigError(
      f"init_weights_seed={c['init_weights_seed']} and seed={c['seed']} + ensemble_size={size} members must stay "
      "below 2**31"
    )
  if size == 1:
    return {"ensemble_learning_rates": rates}
  objective = objectives.select(c)
  if not objective.ensembles:
    raise ConfigError(
      f"ensemble_size={size} with {objective.flag}=true: {objective.name.upper()} is not supported for ensembles"
    )
  for key, what in _UNSUPPORTED:
    if c[key]:
      shown = str(c[key]).lower() if isinstance(c[key], bool) else c[key]
      raise ConfigError(f"ensemble_size={size} with {key}={shown}: {what} is not supported for ensembles")
  if c["num_experts"] > 1:
    raise ConfigError(f"ensemble_size={size} with num_experts={c['num_experts']}: MoE models are not supported")
  return {"ensemble_learning_rates": rates}


def check_mesh(c: dict[str, Any], mesh: dict[str, int]) -> None:
  """The members split evenly over the ensemble mesh axis; pipeline stages are not supported inside a member."""
  size, shards = c["ensemble_size"], mesh["ensemble"]
  if size % shards:
    raise ConfigError(
      f"ensemble_size={size} does not divide over the ensemble mesh axis of {shards} (ici_ensemble_parallelism x "
      f"dcn_ensemble_parallelism): use a multiple of {shards}"
    )
  if size > 1 and mesh["stage"] > 1:
    raise ConfigError(f"ensemble_size={size} with {mesh['stage']} pipeline stages: pipelines are not supported")


def member_learning_rates(c: Any) -> list[float]:
  """Each member's peak learning rate."""
  return list(c.ensemble_learning_rates) or [c.learning_rate] * c.ensemble_size


def member_seed_offsets(c: Any) -> list[int]:
  """What each member adds to init_weights_seed and seed (module docstring)."""
  return [0] * c.ensemble_size if c.ensemble_learning_rates else list(range(c.ensemble_size))
