"""RMSNorm (Zhang & Sennrich 2019) as used by Llama."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxLite.layers.quantities import DType


def rms_norm(x: jax.Array, scale: jax.Array, epsilon: float, dtype: DType) -> jax.Array:
  """x / rms(x) * scale, in `dtype`; the statistics in float32 even for bfloat16 activations (the mean of
  squares loses too much otherwise)."""
  x32 = jnp.asarray(x, jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + epsilon)
  return jnp.asarray(normed * jnp.asarray(scale, jnp.float32), dtype)


class RMSNorm(nn.Module):
  """scale_offset=1: the weight is stored as scale - 1 and starts at 0 (Gemma's convention, kept so its checkpoints
  convert without arithmetic: 1 + w is computed in float32, as transformers does)."""

  epsilon: float = 1e-5
  dtype: DType = jnp.float32
  weight_dtype: DType = jnp.float32
  scale_offset: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    init = nn.initializers.zeros if self.scale_offset else nn.initializers.ones
    scale = self.param("scale", nn.with_logical_partitioning(init, ("norm",)), (x.shape[-1],), self.weight_dtype)
    if self.scale_offset:
      scale = jnp.asarray(scale, jnp.float32) + jnp.float32(self.scale_offset)
    return rms_norm(x, scale, self.epsilon, self.dtype)
