"""Logical axis names -> mesh shardings, via the config's logical_axis_rules (flax nn_partitioning)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxLite.config import Config


def axis_rules(config: Config) -> tuple[tuple[str, Any], ...]:
  """Rules in flax's form: a mesh axis name, a tuple of them, or None for replicated."""
  rules = []
  for name, axes in config.logical_axis_rules:
    if isinstance(axes, str):
      rules.append((name, axes))
    else:
      rules.append((name, tuple(axes) if axes else None))
  return tuple(rules)


def logical_to_sharding(logical_specs: Any, mesh: Mesh, config: Config) -> Any:
  """Tree of logical PartitionSpecs -> tree of NamedShardings on `mesh`."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, axis_rules(config))


def batch_sharding(mesh: Mesh, config: Config) -> NamedSharding:
  """Input batches [batch, seq] are split on the batch axes only; the model reshards the sequence."""
  return logical_to_sharding(PartitionSpec("activation_batch", None), mesh, config)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def describe_shardings(abstract_params: Any, logical_specs: Any, shardings: Any) -> list[str]:
  """One line per parameter: path, shape, logical axes, mesh axes, per-device shape."""
  lines = []
  flat_params = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
  flat_logical = jax.tree.leaves(logical_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  for (path, leaf), logical, sharding in zip(flat_params, flat_logical, flat_shardings):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    local = sharding.shard_shape(leaf.shape)
    lines.append(f"{name:60s} {str(tuple(leaf.shape)):20s} {str(tuple(logical)):45s} -> "
                 f"{str(tuple(sharding.spec)):35s} per-device {tuple(local)}")
  return lines
