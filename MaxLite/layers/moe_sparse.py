"""Dropless mixture of experts by grouped matmul (MaxText's `sparse_matmul=true`).

Each batch shard takes its tokens' top-k (token, expert) pairs, sorts them by expert and runs the SwiGLU
projections as grouped matmuls over the sorted rows (jax's megablox kernel, or `jax.lax.ragged_dot`), so memory
and FLOPs grow with tokens x top_k, not with tokens x experts as in the one-hot dispatch of moe.py. The outputs
are weighted by the router probabilities, unsorted and summed per token. Padding tokens are sorted past the last
expert: they are in no group, so the grouped matmuls give them zeros.

It runs inside shard_map over the mesh: tokens stay on their batch (and sequence) shard, the expert weights
come in whole along embed (gathered as FSDP gathers any weight) and split along mlp over `tensor`, whose
partial sums the down projection adds up. With experts split over `expert`, rows travel to their expert's
shard and back by all_to_all.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import partitioning as nn_partitioning
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox_ops
from jax.sharding import PartitionSpec


def _mesh_axes(name: str, mesh: jax.sharding.AbstractMesh) -> tuple[str, ...]:
  found = dict(nn_partitioning.get_axis_rules()).get(name)
  found = (found,) if isinstance(found, str) else tuple(found or ())
  return tuple(a for a in found if a in mesh.shape and mesh.shape[a] > 1)


def shard_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int | None:
  """Rows each expert takes per batch shard (MaxText's drop semantics); None = dropless."""
  if capacity_factor <= 0:
    return None
  return max(1, math.ceil(tokens * top_k * capacity_factor / num_experts))


def _sort_by_expert(expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(order, sorted ids, group sizes [num_experts]) of rows tagged with expert ids; ids == num_experts (no expert)
  sort last and are in no group."""
  order = jnp.argsort(expert_ids, stable=True)  # earlier rows first within an expert
  sizes = jnp.bincount(expert_ids, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  return order, expert_ids[order], sizes


def _drop_over_capacity(
  order: jax.Array, sorted_expert: jax.Array, sizes: jax.Array, capacity: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Rows sorted by expert -> (order, sorted ids, group sizes, dropped rows) of the kept rows: each expert's first
  `capacity` rows (earlier rows win), in the same order, then rows of no expert up to num_experts * capacity rows.

  The dropped rows leave the groups and the buffer, so that they take no row of the grouped matmuls and no slot of
  the expert-parallel send buffer, where they would crowd out kept rows (and, not sent, be counted again)."""
  n, num_experts = order.shape[0], sizes.shape[0]
  starts = jnp.cumsum(sizes) - sizes
  rank = jnp.arange(n) - starts[jnp.minimum(sorted_expert, num_experts - 1)]
  over = (rank >= capacity) & (sorted_expert < num_experts)
  # A stable partition by one scatter (not a second sort): kept rows close up, dropped ones go last.
  over_before = jnp.cumsum(over) - over
  to = jnp.where(over, n - jnp.sum(over) + over_before, jnp.arange(n) - over_before)
  ids = jnp.zeros_like(sorted_expert).at[to].set(jnp.where(over, num_experts, sorted_expert))
  order = jnp.zeros_like(order).at[to].set(order)
  rows = min(n, num_experts * capacity)  # every kept row is in these
  return order[:rows], ids[:rows], jnp.minimum(sizes, capacity), jnp.sum(over).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class GroupedMatmul:
  """How the grouped matmuls run: jax.lax.ragged_dot, or (megablox) jax's Pallas TPU kernel, interpreted off TPU."""

  megablox: bool = False
  interpret: bool = False
  # rows, contraction, output. MaxText's (512, 1024, 1024) overflows VMEM in jax's backward kernels for Mixtral 8x7B.
  tiling: tuple[int, int, int] = (512, 512, 512)

  def __call__(self, lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, out_dtype: Any = None) -> jax.Array:
    if not self.megablox:
      return jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=out_dtype)
    m, k = lhs.shape
    n = rhs.shape[2]
    tm = min(self.tiling[0], -(-m // 16) * 16)
    padded = -(-m // tm) * tm  # the kernel walks whole row tiles
    # The kernel never writes (nor, backwards, reads) rows past the groups; zeros there keep them out of the sums.
    valid = (jnp.arange(padded) < jnp.sum(sizes))[:, None]
    lhs = jnp.where(valid, jnp.pad(lhs, ((0, padded - m), (0, 0))), 0)
    out = megablox_ops.gmm(
      lhs,
      rhs,
      sizes,
      out_dtype or lhs.dtype,
      (tm, min(self.tiling[1], k), min(self.tiling[2], n)),
      None,
      None,
      False,
      self.interpret,
    )
    return jnp.where(valid, out, 0)[:m]


def silu_gated(gate: jax.Array, up: jax.Array) -> jax.Array:
  """SwiGLU's gated unit: silu(gate) * up."""
  return jax.nn.silu(gate) * up


@dataclasses.dataclass(frozen=True)
class Unit:
  """What each expert computes of its rows: `gated(gate, up)` between the projections, and whether the weights come
  with biases (weights then holds wi_0, wi_1, wo and their biases [experts, mlp], [experts, mlp], [experts, embed])."""

  gated: Callable[[jax.Array, jax.Array], jax.Array] = silu_gated
  biased: bool = False


def _swiglu(
  rows: jax.Array,
  sizes: jax.Array,
  ids: jax.Array,
  weights: tuple[jax.Array, ...],
  unit: Unit,
  tensor_axes: tuple[str, ...],
  matmul: GroupedMatmul,
) -> jax.Array:
  """Rows grouped by expert (group sizes `sizes`, expert `ids`, num_experts past the groups) through their expert's
  gated unit; rows past the groups give 0."""
  wi_0, wi_1, wo = weights[:3]
  gate, up = matmul(rows, wi_0, sizes), matmul(rows, wi_1, sizes)
  grouped = (ids < wi_0.shape[0])[:, None]
  expert = jnp.minimum(ids, wi_0.shape[0] - 1)
  if unit.biased:
    gate, up = gate + weights[3][expert], up + weights[4][expert]
  gate, up = checkpoint_name(gate, "moe_mlpwi_0"), checkpoint_name(up, "moe_mlpwi_1")
  out = matmul(unit.gated(gate, up).astype(rows.dtype), wo, sizes, jnp.float32)
  if tensor_axes:  # each tensor shard holds a slice of mlp: the down projection's partial sums add up
    out = jax.lax.psum(out, tensor_axes)
  if unit.biased:  # once, after the sum over tensor shards
    out = out + jnp.where(grouped, weights[5][expert].astype(jnp.float32), 0.0)
  return checkpoint_name(out.astype(rows.dtype), "moe_mlpwo")


def _on_expert_shards(
  rows: jax.Array,
  sorted_expert: jax.Array,
  sizes: jax.Array,
  weights: tuple[jax.Array, ...],
  expert_axes: tuple[str, ...],
  tensor_axes: tuple[str, ...],
  peers: int,
  slots: int,
  matmul: GroupedMatmul,
  unit: Unit,
) -> tuple[jax.Array, jax.Array]:
  """Expert parallelism: rows sorted by global expert go to the shard that holds their expert (all_to_all into
  a buffer of `slots` rows per peer), through its experts, and back. (out rows, rows that did not fit)."""
  n, d = rows.shape
  local_experts = weights[0].shape[0]
  dest = sorted_expert // local_experts  # == peers for rows of no expert
  per_peer = sizes.reshape(peers, local_experts).sum(axis=1)
  slot = jnp.arange(n) - (jnp.cumsum(per_peer) - per_peer)[jnp.minimum(dest, peers - 1)]
  sent = (dest < peers) & (slot < slots)
  where_to = (jnp.where(sent, dest, peers), jnp.where(sent, slot, 0))  # out of range: mode="drop" skips them
  send = jnp.zeros((peers, slots, d), rows.dtype).at[where_to].set(rows, mode="drop")
  ids = (
    jnp.full((peers, slots), local_experts, jnp.int32)
    .at[where_to]
    .set((sorted_expert % local_experts).astype(jnp.int32), mode="drop")
  )
  got = jax.lax.all_to_all(send, expert_axes, 0, 0).reshape(peers * slots, d)
  got_ids = jax.lax.all_to_all(ids, expert_axes, 0, 0).reshape(peers * slots)
  order, local_ids, local_sizes = _sort_by_expert(got_ids, local_experts)
  done = _swiglu(got[order], local_sizes, local_ids, weights, unit, tensor_axes, matmul)
  back = jnp.zeros_like(done).at[order].set(done).reshape(peers, slots, d)
  back = jax.lax.all_to_all(back, expert_axes, 0, 0)
  out = jnp.where(sent[:, None], back.at[where_to].get(mode="fill", fill_value=0), 0)
  lost = jnp.sum((dest < peers) & ~sent).astype(jnp.float32)
  return out, lost


def _experts_on_shard(
  x: jax.Array,
  weights: jax.Array,
  experts: jax.Array,
  token_mask: jax.Array,
  expert_weights: tuple[jax.Array, ...],
  *,
  num_experts: int,
  capacity_factor: float,
  tensor_axes: tuple[str, ...],
  expert_axes: tuple[str, ...] = (),
  peers: int = 1,
  buffer_factor: float = -1.0,
  matmul: GroupedMatmul = GroupedMatmul(),
  unit: Unit = Unit(),
) -> tuple[jax.Array, jax.Array]:
  """One shard: x [b, s, d], weights/experts [b, s, k], token_mask [b, s] -> (y [b, s, d], dropped pairs);
  expert_weights as Unit says."""
  b, s, d = x.shape
  k = experts.shape[-1]
  tokens = b * s
  real = jnp.repeat(token_mask.reshape(tokens) > 0, k)
  order, sorted_expert, sizes = _sort_by_expert(jnp.where(real, experts.reshape(tokens * k), num_experts), num_experts)
  dropped = jnp.zeros((), jnp.float32)
  capacity = shard_capacity(tokens, num_experts, k, capacity_factor)
  if capacity is not None:
    order, sorted_expert, sizes, dropped = _drop_over_capacity(order, sorted_expert, sizes, capacity)
  # Padding and dropped rows are in no group: the grouped matmuls give them zeros, and so does their weight.
  pair_weight = jnp.where(sorted_expert < num_experts, weights.reshape(tokens * k)[order], 0.0)
  rows = x.reshape(tokens, d)[order // k]
  if expert_axes:
    # A peer takes at most all the rows, and with a capacity at most `capacity` of each of its experts: more
    # slots would only ever be empty. ragged_buffer_factor scales the even share of all top-k assignments.
    slots = rows.shape[0] if buffer_factor <= 0 else max(1, math.ceil(tokens * k * buffer_factor / peers))
    slots = min(slots, rows.shape[0], expert_weights[0].shape[0] * (capacity or rows.shape[0]))
    out, lost = _on_expert_shards(
      rows, sorted_expert, sizes, expert_weights, expert_axes, tensor_axes, peers, slots, matmul, unit
    )
    dropped = dropped + lost
  else:
    out = _swiglu(rows, sizes, sorted_expert, expert_weights, unit, tensor_axes, matmul)
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
  buffer_factor: float = -1.0,
  matmul: GroupedMatmul = GroupedMatmul(),
  biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
  gated: Callable[[jax.Array, jax.Array], jax.Array] = silu_gated,
) -> tuple[jax.Array, jax.Array]:
  """(y [b, s, d], dropped (token, expert) pairs): sum_k weights * expert_{experts}(x), every shard on its own
  tokens; an expert is wo(gated(x wi_0, x wi_1)), with the biases of wi_0, wi_1, wo if given. Weights [experts,
  embed, mlp] / [experts, mlp, embed]. With experts split over devices, each pair travels to its expert's shard in a
  buffer of rows per peer: ragged_buffer_factor x its even share (<= 0: room for all, so nothing is dropped)."""
  mesh = jax.sharding.get_abstract_mesh()
  num_experts = wi_0.shape[0]
  unit = Unit(gated, biases is not None)
  expert_weights = (wi_0, wi_1, wo, *(biases or ()))
  if mesh is None or mesh.empty:
    return _experts_on_shard(
      x,
      weights,
      experts,
      token_mask,
      expert_weights,
      num_experts=num_experts,
      capacity_factor=capacity_factor,
      tensor_axes=(),
      matmul=matmul,
      unit=unit,
    )
  batch, length = _mesh_axes("activation_batch", mesh), _mesh_axes("activation_length", mesh)
  mlp, exp = _mesh_axes("mlp", mesh), _mesh_axes("exp", mesh)
  peers = math.prod(mesh.shape[a] for a in exp)
  tokens = PartitionSpec(batch or None, length or None)
  body = functools.partial(
    _experts_on_shard,
    num_experts=num_experts,
    capacity_factor=capacity_factor,
    tensor_axes=mlp,
    expert_axes=exp,
    peers=peers,
    buffer_factor=buffer_factor,
    matmul=matmul,
    unit=unit,
  )
  weight_specs = (
    PartitionSpec(exp or None, None, mlp or None),
    PartitionSpec(exp or None, None, mlp or None),
    PartitionSpec(exp or None, mlp or None, None),
  )
  if biases is not None:  # split as their kernels' outputs; wo's is added after the sum over mlp shards, so whole
    weight_specs += (PartitionSpec(exp or None, mlp or None),) * 2 + (PartitionSpec(exp or None, None),)
  y, dropped = jax.shard_map(
    lambda *a: _summed(body, batch + length, *a),
    mesh=mesh,
    in_specs=(PartitionSpec(batch or None, length or None, None), tokens, tokens, tokens, weight_specs),
    out_specs=(PartitionSpec(batch or None, length or None, None), PartitionSpec()),
    check_vma=False,
  )(x, weights, experts, token_mask, expert_weights)
  return y, dropped


def _summed(body, token_axes: tuple[str, ...], *args) -> tuple[jax.Array, jax.Array]:
  y, dropped = body(*args)
  return y, jax.lax.psum(dropped, token_axes) if token_axes else dropped
