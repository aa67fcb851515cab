"""RMSNorm (Zhang & Sennrich 2019) as used by Llama."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxLite.layers.quantities import DType


class RMSNorm(nn.Module):
  epsilon: float = 1e-5
  dtype: DType = jnp.float32
  weight_dtype: DType = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    # Statistics in float32 even for bfloat16 activations: the mean of squares loses too much otherwise.
    x32 = jnp.asarray(x, jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    scale = self.param(
      "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (x.shape[-1],), self.weight_dtype
    )
    return jnp.asarray(normed * jnp.asarray(scale, jnp.float32), self.dtype)
