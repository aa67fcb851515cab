"""Attention over a sequence split on the mesh's `sequence` axis, other than by gathering every key (all_gather, which
GSPMD does for the dot-product path and layers/splash.py for the kernel): context_parallel_strategy=ulysses (and the
mesh helper layers/ring_attention.py shares).

Ulysses (DeepSpeed-Ulysses; MaxText's `ulysses`): each device holds 1/N of the tokens of every head. One all-to-all
trades that for every token of 1/N of the heads, attention runs on whole sequences, and a second all-to-all trades
back. Queries, keys and values cross the network once each (where all_gather moves every key and value to every
shard), and no device holds more than its share of any of them. Heads must split over the axis: grouped keys and
values with fewer heads than that are repeated to the query heads first.

The sequence arrives in the load-balanced order (parallel/context.py): the mask compares original indices (`order`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax.linen import partitioning as nn_partitioning
from jax.sharding import PartitionSpec as P


def split_axes(mesh, logical: str) -> tuple[str, ...]:
  """The mesh axes (of more than one device) the logical axis `logical` is split over under the current rules."""
  (axes,) = nn_partitioning.logical_to_mesh_axes((logical,))
  names = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return tuple(a for a in names if mesh.shape[a] > 1)


def ulysses_attention(q, k, v, segment_ids, attend, sinks=None, sliding=True):
  """q [b, s, heads, d]; k, v [b, s, kv_heads, d]; segment_ids [b, s]. attend(q, k, v, segment_ids, sinks, sliding)
  is attention over whole sequences (its mask the caller's, by original index); it runs per device on 1/N of the
  heads. sinks: [heads] or None; sliding: a bool (traced under nn.scan). Without a mesh (or a sequence split), attend
  on everything."""
  mesh = jax.sharding.get_abstract_mesh()
  sliding = jnp.asarray(sliding)
  if mesh is None or mesh.empty or not split_axes(mesh, "activation_length"):
    return attend(q, k, v, segment_ids, sinks, sliding)
  seq_axes = split_axes(mesh, "activation_length")
  (batch_axes,) = nn_partitioning.logical_to_mesh_axes(("activation_batch",))
  head_axes = split_axes(mesh, "activation_heads")
  shards = math.prod(mesh.shape[a] for a in seq_axes)
  head_shards = math.prod(mesh.shape[a] for a in head_axes)
  heads, kv_heads = q.shape[2], k.shape[2]
  if kv_heads % (head_shards * shards):  # too few key/value heads to split: each query head gets its own copy
    k, v = (jnp.repeat(x, heads // kv_heads, axis=2) for x in (k, v))
  seq = seq_axes if len(seq_axes) > 1 else seq_axes[0]
  heads_spec = head_axes if len(head_axes) != 1 else head_axes[0]
  spec = P(batch_axes, seq, heads_spec or None, None)

  def local(q, k, v, segments, sinks, sliding):
    def to_heads(x):  # [b, s/N, h, d] -> [b, s, h/N, d]
      return jax.lax.all_to_all(x, seq, split_axis=2, concat_axis=1, tiled=True)

    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    segments = jax.lax.all_gather(segments, seq, axis=1, tiled=True)
    if sinks is not None:  # this device's heads' sinks: its chunk of the head shard's
      width = q.shape[2]
      sinks = jax.lax.dynamic_slice_in_dim(sinks, jax.lax.axis_index(seq) * width, width)
    out = attend(q, k, v, segments, sinks, sliding)
    return jax.lax.all_to_all(out, seq, split_axis=1, concat_axis=2, tiled=True)

  sharded = jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(spec, spec, spec, P(batch_axes, seq), None if sinks is None else P(heads_spec or None), P()),
    out_specs=spec,
    check_vma=False,
  )
  return sharded(q, k, v, segment_ids, sinks, sliding)
