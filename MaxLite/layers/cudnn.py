"""cuDNN flash attention, exact on packed rows, with no [batch, 1, seq, seq] mask in the program.

A mask passed to cuDNN becomes a bias tensor that the kernel reads for every head (60% slower attention on an
H200); so segments reach cuDNN as what they are:
- one document per row (synthetic data; attention_segments=1): the public `jax.nn.dot_product_attention` with
  `query_seq_lengths` (the padding at the row's end) and `local_window_size`;
- several (packed data): cuDNN's packed layout, each row's segments as offsets and lengths. The public function has
  no offsets, so this path calls jax's `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` (the function
  the public one wraps); its segment count per row is static (attention_segments = max_segments_per_seq, which the
  packer keeps), and cuDNN takes it on Hopper or newer only (config/attention_choice.py checks both).
With implementation="xla" (CPU, tests) the same lengths and offsets become a mask for jax's XLA attention, so the
translation from segment ids is what the tests check against dot_product; the cuDNN call itself is checked by
lowering for CUDA.

Values narrower than queries (MLA) are zero-padded to the query width and the output cut back; positions outside
every segment (padding) come out as zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def packed_layout(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
  """(lengths [b, max_segments], offsets [b, max_segments + 1]) of each row's segments, in cuDNN's packed layout: a
  segment is a run of equal non-zero ids (the packer numbers them 1, 2, ... and pads with 0); unused entries are -1.
  A row with more than max_segments segments keeps only the first max_segments."""
  b, s = segment_ids.shape
  before = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)))
  real = segment_ids > 0
  starts = real & (segment_ids != before)
  offsets = jax.vmap(lambda row: jnp.nonzero(row, size=max_segments, fill_value=-1)[0])(starts).astype(jnp.int32)
  offsets = jnp.pad(offsets, ((0, 0), (0, 1)), constant_values=-1)  # cuDNN's [b, segments + 1]: the last one unused
  index = jnp.cumsum(starts, axis=1) - 1  # which segment each token belongs to (-1 before the first)
  kept = real & (index < max_segments)
  one_hot = (index[:, :, None] == jnp.arange(max_segments)) & kept[:, :, None]
  lengths = jnp.sum(one_hot, axis=1, dtype=jnp.int32)
  return jnp.where(offsets[:, :-1] >= 0, lengths, -1), offsets


def _layout_mask(lengths: jax.Array, offsets: jax.Array, seq: int, window: int) -> jax.Array:
  """[b, 1, seq, seq] boolean: what cuDNN computes from a packed layout (causal within each segment, and within the
  window), for the XLA implementation."""
  t = jnp.arange(seq)
  starts, lengths = offsets[:, :-1, None], lengths[:, :, None]
  member = (starts >= 0) & (t >= starts) & (t < starts + lengths)  # [b, segments, seq]
  same = jnp.einsum("bmq,bmk->bqk", member.astype(jnp.int32), member.astype(jnp.int32)) > 0
  visible = t[None, :, None] >= t[None, None, :]
  if window > 0:
    visible &= t[None, :, None] - t[None, None, :] < window
  return (same & visible)[:, None]


def _packed(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, offsets: jax.Array, window: int) -> jax.Array:
  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  return cudnn.dot_product_attention(
    q,
    k,
    v,
    q_seqlen=lengths,
    kv_seqlen=lengths,
    q_offsets=offsets,
    kv_offsets=offsets,
    scale=1.0,
    mask_type=cudnn.MaskType.PADDING_CAUSAL,
    sliding_window_length=window or None,
  )


def cudnn_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array,
  segments: int,
  window: int = 0,
  implementation: str | None = None,
) -> jax.Array:
  """q [b, s, heads, d] (already scaled); k, v [b, s, kv_heads, d or less]; segment_ids [b, s] (0 = padding).
  segments: the most segments a row holds (1 = one document, padded at its end); window > 0: each query sees its
  `window` latest keys only. implementation: "cudnn" or "xla"; None = cudnn on a GPU, else xla (config validation
  refuses cudnn off a GPU, so only tests reach xla through a model)."""
  if implementation is None:
    implementation = "cudnn" if jax.default_backend() in ("gpu", "cuda") else "xla"
  value_dim = v.shape[-1]
  if value_dim < q.shape[-1]:
    v = jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - value_dim)])
  if segments == 1:
    lengths = jnp.sum(segment_ids > 0, axis=1, dtype=jnp.int32)
    out = jax.nn.dot_product_attention(
      q,
      k,
      v,
      scale=1.0,
      is_causal=True,
      query_seq_lengths=lengths,
      key_value_seq_lengths=lengths,
      local_window_size=(window - 1, 0) if window else None,
      implementation=implementation,
    )
  else:
    lengths, offsets = packed_layout(segment_ids, segments)
    if implementation == "xla":
      mask = _layout_mask(lengths, offsets, q.shape[1], window)
      out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=1.0, implementation="xla")
    else:
      out = _packed(q, k, v, lengths, offsets, window)
  out = jnp.where((segment_ids > 0)[:, :, None, None], out, 0)
  return out[..., :value_dim]
