"""Ring attention (context_parallel_strategy=ring, MaxText's `ring`): keys and values travel around the sequence
shards instead of being gathered, so no device ever holds more than 1/N of them.

Each of the N shards keeps its queries. In N steps every key/value block passes every shard (`ppermute` to the next
shard); each step attends the shard's queries to the block it holds with an online softmax (a running max and sum per
query row, as flash attention keeps per block), and skips a block the mask rules out entirely (without load
balancing, every block from a later shard). The backward is a second ring: each block travels with the gradients of
its keys and values, which every shard adds to, and is home after N steps; the scores of one block at a time are
recomputed from the forward's per-row log-sum-exp. Within a step the block is walked in chunks of `block` keys
(`sa_block_kv`), so neither pass holds more than [queries of a shard, block] scores per head, and a chunk the mask
rules out is skipped on its own.

The mask compares original token indices (`order`, parallel/context.py), so the load-balanced order and packed rows
(segment ids travel with their block) give the causal, same-document attention of one device, windows included.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import partitioning as nn_partitioning
from jax.sharding import PartitionSpec as P

from MaxLite.layers.context_attention import split_axes

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def splits_sequence() -> bool:
  """Whether the current mesh splits the sequence (the activation_length rule) on one axis: where the ring runs (a
  model initialised or applied without a mesh attends as one device does)."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh is not None and not mesh.empty and len(split_axes(mesh, "activation_length")) == 1


def _scores(q, k, cap):
  """Scores [b, kv_heads, groups, Lq, Lk] (float32, soft-capped) of q [b, Lq, kv_heads, groups, d] against keys
  k [b, Lk, kv_heads, d]."""
  scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
  return jnp.tanh(scores / cap) * cap if cap > 0 else scores


def _mask(seg_q, seg_k, ord_q, ord_k, window, sliding):
  """Which scores count [b, 1, 1, Lq, Lk]: causal (and banded) over original indices, within a document."""
  visible = ord_q[:, None] >= ord_k[None, :]
  if window > 0:
    visible = visible & ((ord_q[:, None] - ord_k[None, :] < window) | jnp.logical_not(sliding))
  return (visible[None] & (seg_q[:, :, None] == seg_k[:, None, :]))[:, None, None]


def _chunked(x, axis, size):
  """x with its `axis` (of length n x size) cut into n chunks of `size`, the chunks first: what lax.scan walks."""
  n = x.shape[axis] // size
  return jnp.moveaxis(x.reshape(*x.shape[:axis], n, size, *x.shape[axis + 1 :]), axis, 0)


def _unchunked(x, axis):
  """The inverse of _chunked."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2 :])


def _loop(n, body, carry):
  """body(i, carry) for i < n, as a while loop: the forward is never differentiated (the custom_vjp's backward is the
  ring below), and a remat policy that recomputes the layer partially evaluates the forward rule: a scan there would
  keep every step's scores as residuals (the whole [queries, keys] matrix per layer), a while loop keeps none."""
  return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, body(c[0], c[1])), (jnp.int32(0), carry))[1]


def _ring(x, axis, shards):
  return jax.lax.ppermute(x, axis, [(i, (i + 1) % shards) for i in range(shards)])


def _forward(q, k, v, seg, sinks, sliding, *, order, axis, shards, window, cap, block):
  """This shard's output [b, L, kv_heads, groups, dv] and per-row log-sum-exp [b, kv_heads, groups, L]."""
  me = jax.lax.axis_index(axis)
  length = q.shape[1]
  ord_q = jax.lax.dynamic_slice_in_dim(jnp.asarray(order), me * length, length)
  b, _, kv_heads, groups, _ = q.shape
  acc = jnp.zeros((b, kv_heads, groups, length, v.shape[-1]), jnp.float32)
  top = jnp.full((b, kv_heads, groups, length), _MASK_VALUE, jnp.float32)
  total = jnp.zeros((b, kv_heads, groups, length), jnp.float32)

  def chunk_step(i, state, chunks):
    k, v, seg_k, ord_k = (jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in chunks)
    mask = _mask(seg, seg_k, ord_q, ord_k, window, sliding)

    def attend(acc, top, total):
      scores_masked = jnp.where(mask, _scores(q, k, cap), _MASK_VALUE)
      new_top = jnp.maximum(top, scores_masked.max(-1))
      weights = jnp.where(mask, jnp.exp(scores_masked - new_top[..., None]), 0.0)
      scale = jnp.exp(top - new_top)
      pv = jnp.einsum("bkgqs,bskd->bkgqd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
      return acc * scale[..., None] + pv, new_top, total * scale + weights.sum(-1)

    return jax.lax.cond(jnp.any(mask), attend, lambda *a: a, *state)

  def step(_, carry):
    acc, top, total, k, v, seg_k, ord_k = carry
    chunks = (_chunked(k, 1, block), _chunked(v, 1, block), _chunked(seg_k, 1, block), _chunked(ord_k, 0, block))
    acc, top, total = _loop(len(chunks[-1]), lambda i, state: chunk_step(i, state, chunks), (acc, top, total))
    k, v, seg_k, ord_k = (_ring(x, axis, shards) for x in (k, v, seg_k, ord_k))
    return acc, top, total, k, v, seg_k, ord_k

  acc, top, total, *_ = _loop(shards, step, (acc, top, total, k, v, seg, ord_q))
  if sinks is not None:  # one more logit per head in the denominator, whose weight is dropped
    sink = sinks.astype(jnp.float32).reshape(1, kv_heads, groups, 1)
    new_top = jnp.maximum(top, sink)
    scale = jnp.exp(top - new_top)
    acc, total, top = acc * scale[..., None], total * scale + jnp.exp(sink - new_top), new_top
  out = acc / jnp.maximum(total, 1e-30)[..., None]
  return jnp.moveaxis(out, 3, 1), top + jnp.log(jnp.maximum(total, 1e-30))


def _backward(q, k, v, seg, sinks, sliding, out, lse, d_out, *, order, axis, shards, window, cap, block):
  me = jax.lax.axis_index(axis)
  length = q.shape[1]
  ord_q = jax.lax.dynamic_slice_in_dim(jnp.asarray(order), me * length, length)
  d_out32 = jnp.moveaxis(d_out.astype(jnp.float32), 1, 3)  # [b, kv_heads, groups, L, dv]
  delta = jnp.sum(d_out32 * jnp.moveaxis(out.astype(jnp.float32), 1, 3), -1)  # [b, kv_heads, groups, L]

  def chunk_step(d_q, chunk):
    k, v, seg_k, ord_k, d_k, d_v = chunk
    mask = _mask(seg, seg_k, ord_q, ord_k, window, sliding)

    def grads(d_q, d_k, d_v):
      scores = _scores(q, k, cap)
      probs = jnp.where(mask, jnp.exp(scores - lse[..., None]), 0.0)
      d_v = d_v + jnp.einsum("bkgqs,bkgqd->bskd", probs, d_out32)
      d_probs = jnp.einsum("bkgqd,bskd->bkgqs", d_out32, v.astype(jnp.float32))
      d_scores = probs * (d_probs - delta[..., None])
      if cap > 0:  # through the soft cap: d tanh = 1 - tanh^2
        d_scores = d_scores * (1.0 - jnp.square(scores / cap))
      d_q = d_q + jnp.einsum("bkgqs,bskd->bqkgd", d_scores, k.astype(jnp.float32))
      d_k = d_k + jnp.einsum("bkgqs,bqkgd->bskd", d_scores, q.astype(jnp.float32))
      return d_q, d_k, d_v

    d_q, d_k, d_v = jax.lax.cond(jnp.any(mask), grads, lambda *a: a, d_q, d_k, d_v)
    return d_q, (d_k, d_v)

  def step(carry, _):
    d_q, k, v, seg_k, ord_k, d_k, d_v = carry
    chunks = tuple(_chunked(x, 1, block) for x in (k, v, seg_k)) + (_chunked(ord_k, 0, block),)
    d_q, (d_k, d_v) = jax.lax.scan(chunk_step, d_q, (*chunks, _chunked(d_k, 1, block), _chunked(d_v, 1, block)))
    d_k, d_v = _unchunked(d_k, 1), _unchunked(d_v, 1)
    # The block moves on with its keys' and values' gradients; after N moves it is back on its own shard.
    k, v, seg_k, ord_k, d_k, d_v = (_ring(x, axis, shards) for x in (k, v, seg_k, ord_k, d_k, d_v))
    return (d_q, k, v, seg_k, ord_k, d_k, d_v), None

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
  carry = (zeros(q), k, v, seg, ord_q, zeros(k), zeros(v))
  (d_q, _, _, _, _, d_k, d_v), _ = jax.lax.scan(step, carry, None, length=shards)
  d_sinks = None
  if sinks is not None:  # d/d sink = -(its weight) x delta, over this shard's rows; the caller sums over shards
    sink = sinks.astype(jnp.float32).reshape(1, *lse.shape[1:3], 1)
    d_sinks = -jnp.sum(jnp.exp(sink - lse) * delta, axis=(0, 3)).reshape(-1).astype(sinks.dtype)
  return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_sinks


def ring_attention(q, k, v, segment_ids, order, window=0, cap=0.0, sinks=None, sliding=True, block=512):
  """q [b, s, heads, d]; k, v [b, s, kv_heads, d] (values may be narrower); segment_ids [b, s]; order [s]: each
  place's original index (np.arange(s) when the sequence is not reordered); sinks [heads] or None; sliding: a bool
  (traced under nn.scan) that turns the window on; block: keys per chunk of a shard's block (the largest divisor of
  the shard's length up to it). The sequence is split on the mesh's `sequence` axis (the
  activation_length rule), the batch and heads as the activations are."""
  mesh = jax.sharding.get_abstract_mesh()
  seq_axes = split_axes(mesh, "activation_length") if mesh is not None and not mesh.empty else ()
  if len(seq_axes) != 1:
    raise ValueError(f"ring attention needs the sequence split on one mesh axis, got {seq_axes or 'none'}")
  (axis,) = seq_axes
  (batch_axes,) = nn_partitioning.logical_to_mesh_axes(("activation_batch",))
  head_axes = split_axes(mesh, "activation_heads")
  heads_spec = (head_axes[0] if len(head_axes) == 1 else head_axes) or None
  b, s, heads, _ = q.shape
  if k.shape[2] % math.prod(mesh.shape[a] for a in head_axes):  # too few key/value heads to split: one per query head
    k, v = (jnp.repeat(x, heads // k.shape[2], axis=2) for x in (k, v))
  kv_heads = k.shape[2]
  q = q.reshape(b, s, kv_heads, heads // kv_heads, q.shape[-1])
  shards = mesh.shape[axis]
  chunk = max(d for d in range(1, min(block, s // shards) + 1) if (s // shards) % d == 0)
  static = dict(order=np.asarray(order, np.int32), axis=axis, shards=shards, window=window, cap=cap, block=chunk)
  q_spec, kv_spec, seg_spec = P(batch_axes, axis, heads_spec), P(batch_axes, axis, heads_spec), P(batch_axes, axis)
  sink_spec = None if sinks is None else P(heads_spec)
  other_axes = tuple(a for a in mesh.axis_names if a not in head_axes)
  fwd = jax.shard_map(
    functools.partial(_forward, **static),
    mesh=mesh,
    in_specs=(q_spec, kv_spec, kv_spec, seg_spec, sink_spec, P()),
    out_specs=(q_spec, P(batch_axes, heads_spec, None, axis)),
    check_vma=False,
  )

  def bwd_local(*args):
    d_q, d_k, d_v, d_sinks = _backward(*args, **static)
    if d_sinks is not None:  # every shard of the batch and sequence saw some of each head's rows
      d_sinks = jax.lax.psum(d_sinks, other_axes)
    return d_q, d_k, d_v, d_sinks

  lse_spec = P(batch_axes, heads_spec, None, axis)
  bwd = jax.shard_map(
    bwd_local,
    mesh=mesh,
    in_specs=(q_spec, kv_spec, kv_spec, seg_spec, sink_spec, P(), q_spec, lse_spec, q_spec),
    out_specs=(q_spec, kv_spec, kv_spec, sink_spec),
    check_vma=False,
  )

  @jax.custom_vjp
  def attend(q, k, v, seg, sinks, sliding):
    return fwd(q, k, v, seg, sinks, sliding)[0]

  def attend_fwd(q, k, v, seg, sinks, sliding):
    out, lse = fwd(q, k, v, seg, sinks, sliding)
    return out, (q, k, v, seg, sinks, sliding, out, lse)

  def attend_bwd(residuals, d_out):
    d_q, d_k, d_v, d_sinks = bwd(*residuals, d_out)
    return d_q, d_k, d_v, None, d_sinks, None

  attend.defvjp(attend_fwd, attend_bwd)
  out = attend(q, k, v, segment_ids, sinks, jnp.asarray(sliding))
  return out.reshape(b, s, heads, v.shape[-1]).astype(v.dtype)
