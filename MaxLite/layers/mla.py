"""Multi-head latent attention (DeepSeek-V2/V3; attention_type=mla): keys and values come from a rank-kv_lora_rank
latent of each token, queries optionally through a rank-q_lora_rank bottleneck. Each head's query and key are
qk_nope_head_dim features without RoPE followed by qk_rope_head_dim features with it; the RoPE part of the key is one
vector per token, shared by every head. Values are v_head_dim wide.

RoPE rotates the two halves of the RoPE features (transformers' DeepSeek checkpoints rotate interleaved pairs: the
converter permutes those weight rows once, checkpoint/hf layout of models/deepseek.py). With rope_type=yarn the
softmax scale is (qk_nope + qk_rope)**-0.5 * (0.1 mscale ln(rope_factor) + 1)**2 (mscale is transformers'
mscale_all_dim) and cos/sin are multiplied by rope_attention_factor (layers/rope.py: 1 for DeepSeek's checkpoints,
whose mscale and mscale_all_dim are equal; 0.1 ln(rope_factor) + 1 when they have none), as in transformers.
Decoding caches the uncompressed per-head keys and values.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxLite.config import Config
from MaxLite.layers.attention import BATCH, LENGTH, AttentionCore
from MaxLite.layers.linears import DenseGeneral, quantized_base
from MaxLite.layers.norms import RMSNorm
from MaxLite.layers.quantities import dtype_of
from MaxLite.layers.rope import apply_rope, rope_frequencies, yarn_mscale


def mla_query_scale(cfg: Config) -> float:
  scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
  if cfg.rope_type == "yarn" and cfg.mscale:  # transformers' yarn_apply_mscale: any non-zero mscale_all_dim
    scale *= yarn_mscale(cfg.rope_factor, cfg.mscale) ** 2
  return scale


class MlaAttention(AttentionCore):
  """Multi-head latent attention: queries and keys/values through low-rank latents, RoPE on a part of each head."""

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    cfg = self.config
    dtype, wdtype = dtype_of(cfg.dtype), dtype_of(cfg.weight_dtype)
    dense = dict(dtype=dtype, weight_dtype=wdtype, init_scale=cfg.dense_init_scale, **quantized_base(cfg))
    norm = lambda name: RMSNorm(cfg.normalization_layer_epsilon, dtype, wdtype, name=name)
    heads, nope, rope = cfg.base_num_query_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    per_head = (heads, nope + rope)
    if cfg.q_lora_rank > 0:
      latent_q = DenseGeneral(cfg.q_lora_rank, ("embed", "q_lora"), name="wq_a", **dense)(x)
      q = DenseGeneral(per_head, ("q_lora", "q_heads", "kv"), name="wq_b", **dense)(norm("q_norm")(latent_q))
    else:
      q = DenseGeneral(per_head, ("embed", "q_heads", "kv"), name="query", **dense)(x)
    latent_kv = DenseGeneral(cfg.kv_lora_rank + rope, ("embed", "kv_lora"), name="wkv_a", **dense)(x)
    latent, k_rope = latent_kv[..., : cfg.kv_lora_rank], latent_kv[..., cfg.kv_lora_rank :]
    kv = DenseGeneral((heads, nope + cfg.v_head_dim), ("kv_lora", "kv_heads", "kv"), name="wkv_b", **dense)(
      norm("kv_norm")(latent)
    )
    k_nope, v = kv[..., :nope], kv[..., nope:]

    frequencies, cos_sin = rope_frequencies(cfg, rope)
    q_rope = apply_rope(q[..., nope:], positions, frequencies, cos_sin)
    k_rope = apply_rope(k_rope[:, :, None, :], positions, frequencies, cos_sin)
    q = jnp.concatenate([q[..., :nope], q_rope], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], rope))], axis=-1)
    q = nn.with_logical_constraint(q, (BATCH, LENGTH, "activation_heads", "activation_kv"))
    k = nn.with_logical_constraint(k, (BATCH, LENGTH, "activation_kv_heads", "activation_kv"))
    v = nn.with_logical_constraint(v, (BATCH, LENGTH, "activation_kv_heads", "activation_kv"))
    q = checkpoint_name(q * jnp.asarray(mla_query_scale(cfg), q.dtype), "query_proj")
    k, v = checkpoint_name(k, "key_proj"), checkpoint_name(v, "value_proj")
    return self._attend_and_project(q, k, v, positions, segment_ids, None)
