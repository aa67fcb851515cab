"""Dropless mixture of experts by grouped matmul (MaxText's `sparse_matmul=true`).

Each batch shard takes its tokens' top-k (token, expert) pairs, sorts them by expert and runs the SwiGLU
projections as grouped matmuls over the sorted rows (`jax.lax.ragged_dot`), so memory and FLOPs grow with
tokens x top_k, not with tokens x experts as in the one-hot dispatch of moe.py. The outputs are weighted by
the router probabilities, unsorted and summed per token. Padding tokens are sorted past the last expert:
they are in no group, so the grouped matmuls give them zeros.

It runs inside shard_map over the mesh: tokens stay on their batch (and sequence) shard, the expert weights
come in whole along embed (gathered as FSDP gathers any weight) and split along mlp over `tensor`, whose
partial sums the down projection adds up.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax.linen import partitioning as nn_partitioning
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from MaxLite.errors import ConfigError


def _mesh_axes(name: str, mesh: jax.sharding.AbstractMesh) -> tuple[str, ...]:
  found = dict(nn_partitioning.get_axis_rules()).get(name)
  found = (found,) if isinstance(found, str) else tuple(found or ())
  return tuple(a for a in found if a in mesh.shape and mesh.shape[a] > 1)


def shard_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int | None:
  """Rows each expert takes per batch shard (MaxText's drop semantics); None = dropless."""
  if capacity_factor <= 0:
    return None
  return max(1, math.ceil(tokens * top_k * capacity_factor / num_experts))


def _experts_on_shard(
  x: jax.Array,
  weights: jax.Array,
  experts: jax.Array,
  token_mask: jax.Array,
  wi_0: jax.Array,
  wi_1: jax.Array,
  wo: jax.Array,
  *,
  capacity_factor: float,
  tensor_axes: tuple[str, ...],
) -> tuple[jax.Array, jax.Array]:
  """One shard: x [b, s, d], weights/experts [b, s, k], token_mask [b, s] -> (y [b, s, d], dropped pairs)."""
  b, s, d = x.shape
  k, num_experts = experts.shape[-1], wi_0.shape[0]
  tokens = b * s
  real = jnp.repeat(token_mask.reshape(tokens) > 0, k)
  expert_of_pair = jnp.where(real, experts.reshape(tokens * k), num_experts)  # padding: past the last group
  order = jnp.argsort(expert_of_pair, stable=True)  # earlier tokens first within an expert
  sorted_expert = expert_of_pair[order]
  group_sizes = jnp.bincount(expert_of_pair, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  pair_weight = jnp.where(real, weights.reshape(tokens * k), 0.0)[order]
  dropped = jnp.zeros((), jnp.float32)
  capacity = shard_capacity(tokens, num_experts, k, capacity_factor)
  if capacity is not None:
    starts = jnp.cumsum(group_sizes) - group_sizes
    rank = jnp.arange(tokens * k) - starts[jnp.minimum(sorted_expert, num_experts - 1)]
    kept = (rank < capacity) | (sorted_expert == num_experts)
    dropped = jnp.sum(~kept).astype(jnp.float32)
    pair_weight = jnp.where(kept, pair_weight, 0.0)
  rows = x.reshape(tokens, d)[order // k]
  gate = checkpoint_name(jax.lax.ragged_dot(rows, wi_0, group_sizes), "moe_mlpwi_0")
  up = checkpoint_name(jax.lax.ragged_dot(rows, wi_1, group_sizes), "moe_mlpwi_1")
  out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, wo, group_sizes, preferred_element_type=jnp.float32)
  if tensor_axes:  # each tensor shard holds a slice of mlp: the down projection's partial sums add up
    out = jax.lax.psum(out, tensor_axes)
  out = checkpoint_name(out.astype(x.dtype), "moe_mlpwo")
  weighted = out * pair_weight[:, None].astype(x.dtype)
  y = jnp.zeros((tokens, d), x.dtype).at[order // k].add(weighted)
  return y.reshape(b, s, d), dropped


def sparse_experts(
  x: jax.Array,
  weights: jax.Array,
  experts: jax.Array,
  token_mask: jax.Array,
  wi_0: jax.Array,
  wi_1: jax.Array,
  wo: jax.Array,
  capacity_factor: float,
) -> tuple[jax.Array, jax.Array]:
  """(y [b, s, d], dropped (token, expert) pairs): sum_k weights * SwiGLU_{experts}(x), every shard on its own
  tokens. Weights [experts, embed, mlp] / [experts, mlp, embed]."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return _experts_on_shard(
      x, weights, experts, token_mask, wi_0, wi_1, wo, capacity_factor=capacity_factor, tensor_axes=()
    )
  if _mesh_axes("exp", mesh):
    raise ConfigError(
      "sparse_matmul=true does not split experts over devices yet (ici/dcn_expert_parallelism > 1): use "
      "sparse_matmul=false for expert parallelism"
    )
  batch, length = _mesh_axes("activation_batch", mesh), _mesh_axes("activation_length", mesh)
  mlp = _mesh_axes("mlp", mesh)
  tokens = PartitionSpec(batch or None, length or None)
  body = functools.partial(_experts_on_shard, capacity_factor=capacity_factor, tensor_axes=mlp)
  y, dropped = jax.shard_map(
    lambda *a: _summed(body, batch + length, *a),
    mesh=mesh,
    in_specs=(
      PartitionSpec(batch or None, length or None, None),
      tokens,
      tokens,
      tokens,
      PartitionSpec(None, None, mlp or None),
      PartitionSpec(None, None, mlp or None),
      PartitionSpec(None, mlp or None, None),
    ),
    out_specs=(PartitionSpec(batch or None, length or None, None), PartitionSpec()),
    check_vma=False,
  )(x, weights, experts, token_mask, wi_0, wi_1, wo)
  return y, dropped


def _summed(body, token_axes: tuple[str, ...], *args) -> tuple[jax.Array, jax.Array]:
  y, dropped = body(*args)
  return y, jax.lax.psum(dropped, token_axes) if token_axes else dropped
