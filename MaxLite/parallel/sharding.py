"""Logical axis names -> mesh shardings, via the config's logical_axis_rules (flax nn_partitioning)."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
from flax.linen import partitioning as nn_partitioning
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxLite.config import Config
from MaxLite.config.choices import MESH_AXES
from MaxLite.config.keys_derived import rule_mesh_axes

# The residual stream's logical axes: every layer constrains its input and output to these.
EMBED_ACTIVATION = ("activation_batch", "activation_length", "activation_embed")


def axis_rules(config: Config) -> tuple[tuple[str, Any], ...]:
  """Rules in flax's form: a mesh axis name, a tuple of them, or None for replicated; activation_embed whole on each
  device where `swaps_batch_shards` says XLA would otherwise compute the wrong rows."""
  rules = []
  for name, axes in config.logical_axis_rules:
    if isinstance(axes, str):
      rules.append((name, axes))
    else:
      rules.append((name, tuple(axes) if axes else None))
  if swaps_batch_shards(config.logical_axis_rules, dict(zip(MESH_AXES, config.mesh_shape))):
    return _embed_whole(rules)
  return tuple(rules)


def swaps_batch_shards(rules: Any, mesh: dict[str, int]) -> bool:
  """Whether this layout meets a bug of XLA's SPMD partitioner (jax 0.10.2 and 0.11.2, XLA:CPU; the GPU shares the
  partitioner): a dot whose input and output both split their feature dim over `tensor` while its weight splits one
  dim over `tensor` and the other over an axis that also splits the batch, but not as the batch's first split axis
  (the batch over data x fsdp, the weights' embed over fsdp). XLA then moves whole batch shards between devices and
  never moves them back: in `bsm,me->bse` with x[(data,fsdp), -, tensor], w[tensor, fsdp] and the output constrained
  to [(data,fsdp), -, tensor], shards (data 0, fsdp 1) and (data 1, fsdp 0) come out swapped, at 1, 2 and 8 rows per
  shard depending on the other dims (the forward pass, its gradients, the logits, every projection of the residual
  stream). Keeping the residual stream (activation_embed) whole on each device removes every such dot: one side of
  each projection is then unsplit. tests/parallel/test_batch_shard_layouts.py is the sweep that finds it."""
  if math.prod(mesh.get(a, 1) for a in rule_mesh_axes(rules, "activation_embed")) == 1:
    return False
  split_batch = [a for a in rule_mesh_axes(rules, "activation_batch") if mesh.get(a, 1) > 1]
  weight_axes = {a for logical in ("embed", "q_lora", "kv_lora") for a in rule_mesh_axes(rules, logical)}
  return any(a in weight_axes for a in split_batch[1:])


def _embed_whole(rules: Any) -> tuple[tuple[str, Any], ...]:
  return tuple((name, None if name == "activation_embed" else axes) for name, axes in rules)


def decode_axis_rules(config: Config) -> tuple[tuple[str, Any], ...]:
  """The rules a KV-cache decoder traces under: the residual stream (activation_embed) whole on each device on every
  layout, not only where `swaps_batch_shards` says so: decoding is bound by reading the weights and the cache, not by
  this activation, so keeping it whole costs little, and a decode step's shapes (one token a row) are the ones the
  partitioner bug reaches most often."""
  return _embed_whole(axis_rules(config))


def traced_under(rules: tuple[tuple[str, Any], ...], jitted: Any) -> Any:
  """`jitted`, called (and so traced, at its first call) under these logical axis rules."""

  def call(*args: Any) -> Any:
    with nn_partitioning.axis_rules(rules):
      return jitted(*args)

  return call


def logical_to_sharding(logical_specs: Any, mesh: Mesh, config: Config) -> Any:
  """Tree of logical PartitionSpecs -> tree of NamedShardings on `mesh`."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, axis_rules(config))


def logical_axis_is_split(name: str) -> bool:
  """Whether the logical axis `name` is split over more than one device under the active axis rules
  (nn_partitioning.axis_rules) and mesh (jax.set_mesh); False outside any mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return False
  for logical, axes in nn_partitioning.get_axis_rules():
    if logical == name:
      axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
      return math.prod(mesh.shape[a] for a in axes) > 1
  return False


HOST, DEVICE = "pinned_host", "device"


def with_host_offload(state_shardings: Any, config: Config) -> Any:
  """The train state's shardings with params and/or optimizer state kept in pinned host memory between steps
  (parameter_memory_host_offload / optimizer_memory_host_offload); the step moves them to the device and back."""

  def host(tree: Any) -> Any:
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), tree, is_leaf=_is_sharding)

  replace = {}
  if config.parameter_memory_host_offload:
    replace["params"] = host(state_shardings.params)
  if config.optimizer_memory_host_offload:
    replace["opt_state"] = host(state_shardings.opt_state)
  return state_shardings.replace(**replace) if replace else state_shardings


def on_device(tree: Any, shardings: Any) -> Any:
  """Inside jit: `tree` moved to device memory (a no-op for arrays already there)."""
  if all(s.memory_kind in (None, DEVICE) for s in jax.tree.leaves(shardings, is_leaf=_is_sharding)):
    return tree
  return jax.device_put(tree, jax.tree.map(lambda s: s.with_memory_kind(DEVICE), shardings, is_leaf=_is_sharding))


def batch_sharding(mesh: Mesh, config: Config, loaded: bool = False) -> NamedSharding:
  """Input batches [batch, seq] are split on the batch axes only; the model reshards the sequence. loaded=True: the
  rows the training input loads, which with ensemble_data=distinct are every member's batch, member-major, so the
  ensemble axis splits them first."""
  if loaded and config.ensemble_size > 1 and config.ensemble_data == "distinct":
    return NamedSharding(mesh, PartitionSpec(("ensemble", *config.batch_mesh_axes), None))
  return logical_to_sharding(PartitionSpec("activation_batch", None), mesh, config)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def sharded_bytes(abstract: Any, shardings: Any) -> int:
  """Bytes one device holds for arrays of these shapes placed with these shardings (no arrays needed)."""
  total = 0
  for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings, is_leaf=_is_sharding)):
    total += math.prod(sharding.shard_shape(leaf.shape)) * _bits(leaf.dtype) // 8
  return total


def _bits(dtype: Any) -> int:
  """A device's bits per element: 4 for int4/uint4 (QLoRA's nf4 codes), whose numpy itemsize says a whole byte."""
  try:
    return int(jax.numpy.iinfo(dtype).bits)
  except ValueError:
    return 8 * dtype.itemsize


def sharding_report(abstract_params: Any, logical_specs: Any, shardings: Any) -> str:
  """One line per parameter: path, global shape, logical axes -> mesh axes, per-device shape."""
  flat_params = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
  flat_logical = jax.tree.leaves(logical_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  flat_shardings = jax.tree.leaves(shardings, is_leaf=_is_sharding)
  rows = [("parameter", "shape", "logical axes", "mesh axes", "per device")]
  for (path, leaf), logical, sharding in zip(flat_params, flat_logical, flat_shardings):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    mesh_axes = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
    rows.append(
      (name, _shape(leaf.shape), _axes(tuple(logical)), _axes(mesh_axes), _shape(sharding.shard_shape(leaf.shape)))
    )
  widths = [max(len(r[i]) for r in rows) for i in range(4)]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
  total = sum(leaf.size * leaf.dtype.itemsize for _, leaf in flat_params)
  lines.append(
    f"parameters: {total / 2**20:.2f} MiB in total, "
    f"{sharded_bytes(abstract_params, shardings) / 2**20:.2f} MiB per device"
  )
  return "\n".join(lines)


def _is_sharding(x: Any) -> bool:
  return isinstance(x, NamedSharding)


def _shape(shape: tuple[int, ...]) -> str:
  return "(" + ", ".join(str(d) for d in shape) + ")"


def _axes(axes: tuple[Any, ...]) -> str:
  def one(a: Any) -> str:
    if a is None:
      return "-"
    return a if isinstance(a, str) else "+".join(a)

  return "(" + ", ".join(one(a) for a in axes) + ")"


def unbox(tree: Any) -> Any:
  """Strip logical-partitioning boxes without adding sharding constraints (shardings come from jit)."""
  return jax.tree.map(
    lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.Partitioned) else x,
    tree,
    is_leaf=lambda x: isinstance(x, nn.Partitioned),
  )
