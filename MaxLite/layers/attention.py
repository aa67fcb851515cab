"""Causal grouped-query self-attention that never attends across packed-segment boundaries."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxLite.config import Config
from MaxLite.layers.embeddings import apply_rope
from MaxLite.layers.linears import DenseGeneral
from MaxLite.layers.quantities import dtype_of

BATCH, LENGTH = "activation_batch", "activation_length"
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so fully padded rows stay NaN-free


def attention_mask(segment_ids: jax.Array) -> jax.Array:
  """[batch, 1, 1, q, k] boolean: causal and within the same (non-padding) segment."""
  seq = segment_ids.shape[-1]
  causal = jnp.tril(jnp.ones((seq, seq), dtype=jnp.bool_))
  same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
  return (causal[None] & same_segment)[:, None, None, :, :]


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """q [b, s, heads, d]; k, v [b, s, kv_heads, d]; heads = kv_heads * groups. Softmax in float32."""
  b, s, heads, d = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, s, kv_heads, heads // kv_heads, d)
  scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
  scores = jnp.where(mask, scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
  return out.reshape(b, s, heads, d)


class Attention(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
    cfg = self.config
    dtype, wdtype = dtype_of(cfg.dtype), dtype_of(cfg.weight_dtype)
    scale = cfg.param_init_scale

    def project(name: str, heads: int, head_axis: str) -> jax.Array:
      y = DenseGeneral((heads, cfg.head_dim), ("embed", head_axis, "kv"), dtype=dtype, weight_dtype=wdtype,
                       init_scale=scale, name=name)(x)
      return checkpoint_name(y, f"{name}_proj")

    q = project("query", cfg.base_num_query_heads, "q_heads")
    k = project("key", cfg.base_num_kv_heads, "kv_heads")
    v = project("value", cfg.base_num_kv_heads, "kv_heads")
    q = nn.with_logical_constraint(q, (BATCH, LENGTH, "activation_heads", "activation_kv"))
    k = nn.with_logical_constraint(k, (BATCH, LENGTH, "activation_kv_heads", "activation_kv"))
    v = nn.with_logical_constraint(v, (BATCH, LENGTH, "activation_kv_heads", "activation_kv"))

    q = apply_rope(q, positions, cfg.rope_max_timescale)
    k = apply_rope(k, positions, cfg.rope_max_timescale)
    q = q * jnp.asarray(cfg.head_dim ** -0.5, q.dtype)
    out = dot_product_attention(q, k, v, attention_mask(segment_ids))
    out = nn.with_logical_constraint(out, (BATCH, LENGTH, "activation_heads", "activation_kv"))

    out = DenseGeneral(cfg.base_emb_dim, ("heads", "kv", "embed"), axis=(-2, -1), dtype=dtype,
                       weight_dtype=wdtype, init_scale=scale, name="out")(out)
    return checkpoint_name(out, "out_proj")
