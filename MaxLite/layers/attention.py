"""Causal grouped-query self-attention that never attends across packed-segment boundaries.

Three implementations of the same function (config key `attention`, resolved to `attention_kernel`):
dot_product (XLA, materialises the [seq, seq] scores: fine on CPU and for short sequences), splash (the Pallas
TPU flash kernel, layers/splash.py) and cudnn (cuDNN flash attention on GPU, layers/cudnn.py). What each computes
is declared in config/attention_choice.py, which checks the chosen one against the config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from MaxLite.config import Config
from MaxLite.layers import ring_attention
from MaxLite.layers.context_attention import ulysses_attention
from MaxLite.layers.cudnn import cudnn_attention
from MaxLite.layers.linears import DenseGeneral, quantized_base
from MaxLite.layers.norms import RMSNorm
from MaxLite.layers.quantities import dtype_of
from MaxLite.layers.rope import apply_rope, rope_frequencies
from MaxLite.layers.splash import splash_attention
from MaxLite.parallel import context
from MaxLite.parallel.sharding import EMBED_ACTIVATION

BATCH, LENGTH = "activation_batch", "activation_length"
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so fully padded rows stay NaN-free


def attention_mask(
  segment_ids: jax.Array, window: int = 0, sliding: Any = True, order: np.ndarray | None = None
) -> jax.Array:
  """[batch, 1, 1, q, k] boolean: causal and within the same (non-padding) segment; with a window > 0, where
  `sliding` (a bool, traced under nn.scan) also only the `window` latest keys: q - window < k <= q. order [seq]: each
  place's original index in a load-balanced sequence (parallel/context.py), which causality and windows compare."""
  seq = segment_ids.shape[-1]
  index = np.arange(seq) if order is None else np.asarray(order)
  causal = jnp.asarray(index[:, None] >= index[None, :])
  if window > 0:
    in_window = jnp.asarray(index[:, None] - index[None, :] < window)
    causal = causal & (in_window | jnp.logical_not(sliding))
  same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
  return (causal[None] & same_segment)[:, None, None, :, :]


def soft_cap(scores: jax.Array, cap: float) -> jax.Array:
  """cap * tanh(scores / cap) (Gemma 2's logit soft-capping); cap <= 0 = none."""
  return scores if cap <= 0 else jnp.tanh(scores / cap) * cap


@dataclasses.dataclass(frozen=True)
class AttentionFeatures:
  """What a family's attention adds to grouped-query attention. The family decides them from its own keys, so this
  layer reads none of them. sinks: a learned logit per query head that joins each softmax's denominator (a query may
  give its keys less than all of its weight); out_bias: a learned bias on the output projection."""

  sinks: bool = False
  out_bias: bool = False


def softmax_with_sinks(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
  """Softmax over the last axis of float32 scores [b, kv_heads, groups, q, k]; sinks [heads] (heads = kv_heads *
  groups), if given, each one more logit in its head's denominator, whose weight is dropped."""
  if sinks is None:
    return jax.nn.softmax(scores, axis=-1)
  kv_heads, groups = scores.shape[1], scores.shape[2]
  sink = sinks.astype(jnp.float32).reshape(1, kv_heads, groups, 1, 1)
  top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
  weights = jnp.exp(scores - top)
  return weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sink - top))


def dot_product_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  cap: float = 0.0,
  sinks: jax.Array | None = None,
  kv_layout: str = "bskd",
) -> jax.Array:
  """q [b, s, heads, d]; k, v [b, s, kv_heads, d], or with kv_layout="bksd" [b, kv_heads, s, d] (the KV cache's
  layout); heads = kv_heads * groups. Softmax in float32, after the scores' soft cap (cap > 0), with the sinks [heads]
  in its denominators (softmax_with_sinks)."""
  b, s, heads, d = q.shape
  kv_heads = k.shape[kv_layout.index("k")]
  q = q.reshape(b, s, kv_heads, heads // kv_heads, d)
  scores = jnp.einsum(f"bqkgd,{kv_layout}->bkgqs", q, k, preferred_element_type=jnp.float32)
  scores = jnp.where(mask, soft_cap(scores, cap), _MASK_VALUE)
  probs = softmax_with_sinks(scores, sinks).astype(v.dtype)
  out = jnp.einsum(f"bkgqs,{kv_layout}->bqkgd", probs, v)
  return out.reshape(b, s, heads, v.shape[-1])  # MLA's values may be narrower than its queries


def cached_attention_mask(
  positions: jax.Array, segment_ids: jax.Array, cached_segments: jax.Array, window: int = 0, sliding: Any = True
) -> jax.Array:
  """[batch, 1, 1, q, cache_len]: queries at `positions` see cache slots at or before them that hold
  a token of their own segment (a slot holds the token whose position equals its index); with a window, where
  `sliding`, only the `window` latest."""
  slots = jnp.arange(cached_segments.shape[-1])
  visible = slots[None, None, :] <= positions[:, :, None]
  if window > 0:
    in_window = slots[None, None, :] > positions[:, :, None] - window
    visible = visible & (in_window | jnp.logical_not(sliding))
  same_segment = cached_segments[:, None, :] == segment_ids[:, :, None]
  return (visible & same_segment)[:, None, None, :, :]


class AttentionCore(nn.Module):
  """What every attention variant shares once it has its queries, keys and values: the kernel the config chose, the
  KV cache when decoding (decode=True keeps keys and values in a "cache" collection [batch, kv_heads, slots, ...];
  each call writes its tokens at their positions and attends over everything cached so far), and the output
  projection."""

  config: Config
  decode: bool = False
  features: AttentionFeatures = AttentionFeatures()

  def _attend_and_project(
    self,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    sliding: Any,
  ) -> jax.Array:
    """Attention of scaled q over k, v (the KV cache when decoding), then the output projection; `sliding` as
    Attention's."""
    cfg = self.config
    window = cfg.sliding_window_size if sliding is not None else 0
    cap = cfg.attn_logits_soft_cap
    sinks = None
    if self.features.sinks:  # one logit per query head (replicated: [heads] numbers)
      init = nn.with_logical_partitioning(nn.initializers.zeros, (None,))
      sinks = self.param("sinks", init, (q.shape[2],), dtype_of(cfg.weight_dtype))
    # A load-balanced sequence (models/transformer.py reordered it): the mask compares original indices.
    order = None if self.decode else context.order_of(cfg, q.shape[1])
    if self.decode:
      k, v, mask = self._update_cache(k, v, positions, segment_ids, window, sliding)
      out = dot_product_attention(q, k, v, mask, cap, sinks, kv_layout="bksd")
    elif cfg.context_parallel_strategy == "ulysses" and cfg.sequence_shards > 1:  # whole sequences of some heads
      splash, interpret = cfg.attention_kernel == "splash", cfg.attention_interpret

      def attend(q, k, v, segments, sinks, sliding):
        if not splash:
          return dot_product_attention(q, k, v, attention_mask(segments, window, sliding, order), cap, sinks)

        def kernel(w):
          return splash_attention(q, k, v, segments, cfg, interpret, w, cap, sinks, order, local=True)

        return jax.lax.cond(sliding, lambda: kernel(window), lambda: kernel(0)) if window else kernel(0)

      out = ulysses_attention(q, k, v, segment_ids, attend, sinks, True if sliding is None else sliding)
    elif cfg.context_parallel_strategy == "ring" and cfg.sequence_shards > 1 and ring_attention.splits_sequence():
      ring_order = np.arange(q.shape[1]) if order is None else order
      # Keys and values go round the sequence shards (layers/ring_attention.py).
      out = ring_attention.ring_attention(
        q, k, v, segment_ids, ring_order, window, cap, sinks, True if sliding is None else sliding, cfg.sa_block_kv
      )
    elif cfg.attention_kernel == "splash":
      interpret = cfg.attention_interpret

      def attend(w):
        return splash_attention(q, k, v, segment_ids, cfg, interpret, window=w, cap=cap, sinks=sinks, order=order)

      # Both kernels are compiled; the layer runs one (nn.scan traces a single layer for local and global ones).
      out = jax.lax.cond(sliding, lambda: attend(window), lambda: attend(0)) if window else attend(0)
    elif cfg.attention_kernel == "cudnn":
      # config/attention_choice.py gives a config with sinks another kernel (cuDNN's declares none).
      assert sinks is None, "the cudnn kernel computes no attention sinks"
      assert order is None, "the cudnn kernel takes whole rows (no sequence split, so no reordered one)"
      attend = lambda w: cudnn_attention(q, k, v, segment_ids, cfg.attention_segments, window=w)
      out = jax.lax.cond(sliding, lambda: attend(window), lambda: attend(0)) if window else attend(0)
    else:
      out = dot_product_attention(q, k, v, attention_mask(segment_ids, window, sliding, order), cap, sinks)
    out = nn.with_logical_constraint(out, (BATCH, LENGTH, "activation_heads", "activation_kv"))
    out = checkpoint_name(out, "context")
    out = DenseGeneral(
      cfg.base_emb_dim,
      ("heads", "kv", "embed"),
      axis=(-2, -1),
      dtype=dtype_of(cfg.dtype),
      weight_dtype=dtype_of(cfg.weight_dtype),
      init_scale=cfg.dense_init_scale,
      use_bias=self.features.out_bias,
      name="out",
      **quantized_base(cfg),
    )(out)
    # Constrained before it is named: with activation_embed split over `tensor` the saved copy is the
    # reduce-scattered shard, not the all-reduced whole.
    return checkpoint_name(nn.with_logical_constraint(out, EMBED_ACTIVATION), "out_proj")

  def _update_cache(
    self, k: jax.Array, v: jax.Array, positions: jax.Array, segment_ids: jax.Array, window: int, sliding: Any
  ) -> tuple:
    b, length = k.shape[0], self.config.max_target_length
    # Heads before slots: the attention's dots read the cache with their batch axes (row, head) leading, as stored.
    # Slots first made XLA transpose every layer's whole cache at every step: 60% of a decode step at batch 16 and
    # 1,024 slots on CPU, a cost that grew with batch x max_target_length rather than with the tokens held.
    axes = (BATCH, "activation_kv_heads", None, "activation_kv")
    cached_k = self.variable("cache", "cached_key", jnp.zeros, (b, k.shape[2], length, k.shape[3]), k.dtype)
    cached_v = self.variable("cache", "cached_value", jnp.zeros, (b, v.shape[2], length, v.shape[3]), v.dtype)
    cached_seg = self.variable("cache", "cached_segment_ids", jnp.zeros, (b, length), jnp.int32)
    rows = jnp.arange(b)[:, None]
    # rows [b, 1] and positions [b, q] index around the heads' slice: the indexed values are [b, q, kv_heads, d], k's.
    cached_k.value = nn.with_logical_constraint(cached_k.value.at[rows, :, positions].set(k), axes)
    cached_v.value = nn.with_logical_constraint(cached_v.value.at[rows, :, positions].set(v), axes)
    cached_seg.value = cached_seg.value.at[rows, positions].set(segment_ids)
    mask = cached_attention_mask(positions, segment_ids, cached_seg.value, window, sliding)
    return cached_k.value, cached_v.value, mask


class Attention(AttentionCore):
  """Multi-head attention with grouped keys and values (MHA, GQA, MQA), optional q/k norms and biases.

  sliding (a bool, traced under nn.scan where layers differ): this layer attends within sliding_window_size; None =
  full causal attention. rope: (frequencies, scale) for a family whose layers turn differently (Gemma 3's local
  ones); None = the config's RoPE."""

  qk_norm_offset: float = 0.0  # the q/k norms' weight convention (layers/norms.py; Gemma: 1)

  @nn.compact
  def __call__(
    self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, sliding: Any = None, rope: Any = None
  ) -> jax.Array:
    cfg = self.config
    dtype, wdtype = dtype_of(cfg.dtype), dtype_of(cfg.weight_dtype)
    scale = cfg.dense_init_scale

    dense = dict(dtype=dtype, weight_dtype=wdtype, init_scale=scale, use_bias=cfg.attention_bias, **quantized_base(cfg))
    if cfg.fused_qkv:  # one [embed, 3, heads, head_dim] kernel (MHA only: the three parts have one head count)
      heads = (3, cfg.base_num_query_heads, cfg.head_dim)
      qkv = DenseGeneral(heads, ("embed", "qkv", "heads", "kv"), name="qkv_proj", **dense)(x)
      qkv = nn.with_logical_constraint(qkv, (BATCH, LENGTH, None, "activation_heads", "activation_kv"))
      qkv = checkpoint_name(qkv, "qkv_proj")
      q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
      q = DenseGeneral((cfg.base_num_query_heads, cfg.head_dim), ("embed", "q_heads", "kv"), name="query", **dense)(x)
      k = DenseGeneral((cfg.base_num_kv_heads, cfg.head_dim), ("embed", "kv_heads", "kv"), name="key", **dense)(x)
      v = DenseGeneral((cfg.base_num_kv_heads, cfg.head_dim), ("embed", "kv_heads", "kv"), name="value", **dense)(x)
    if cfg.use_qk_norm:  # Qwen3: RMSNorm over each head's features, before RoPE
      eps, offset = cfg.normalization_layer_epsilon, self.qk_norm_offset
      q = RMSNorm(eps, dtype, wdtype, offset, name="query_norm")(q)
      k = RMSNorm(eps, dtype, wdtype, offset, name="key_norm")(k)
    q = nn.with_logical_constraint(q, (BATCH, LENGTH, "activation_heads", "activation_kv"))
    k = nn.with_logical_constraint(k, (BATCH, LENGTH, "activation_kv_heads", "activation_kv"))
    v = nn.with_logical_constraint(v, (BATCH, LENGTH, "activation_kv_heads", "activation_kv"))

    frequencies, rope_scale = rope_frequencies(cfg) if rope is None else rope
    q = apply_rope(q, positions, frequencies, rope_scale)
    k = apply_rope(k, positions, frequencies, rope_scale)
    # Named as attention reads them (after norm, RoPE and scaling), so a saved q/k/v needs nothing recomputed.
    q = checkpoint_name(q * jnp.asarray(query_scale(cfg), q.dtype), "query_proj")
    k, v = checkpoint_name(k, "key_proj"), checkpoint_name(v, "value_proj")
    return self._attend_and_project(q, k, v, positions, segment_ids, sliding)


def query_scale(cfg: Config) -> float:
  """What q is multiplied by: head_dim**-0.5, or query_pre_attn_scalar**-0.5 where a model sets it (Gemma 3 27B)."""
  return (cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar > 0 else cfg.head_dim) ** -0.5
