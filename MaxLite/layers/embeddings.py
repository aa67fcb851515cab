"""Token embedding and rotary position embedding (RoPE)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxLite.layers.quantities import DType


class Embed(nn.Module):
  """Token embedding table (vocab, embed); `attend` gives tied output logits."""

  num_embeddings: int
  features: int
  dtype: DType = jnp.float32
  weight_dtype: DType = jnp.float32

  def setup(self):
    # std 1/sqrt(embed): tied logits x.E^T then start near unit scale, and the first RMSNorm
    # makes the residual stream's starting scale irrelevant for the untied case.
    init = nn.initializers.normal(stddev=self.features**-0.5)
    self.embedding = self.param(
      "embedding",
      nn.with_logical_partitioning(init, ("vocab", "embed")),
      (self.num_embeddings, self.features),
      self.weight_dtype,
    )

  def __call__(self, ids: jax.Array) -> jax.Array:
    # Gather the table's embed dimension first (as FSDP does for every weight): a lookup from a
    # table split along embed would otherwise need an all-to-all GSPMD cannot do without
    # replicating the whole output.
    table = nn.with_logical_constraint(jnp.asarray(self.embedding, self.dtype), ("vocab", None))
    return jnp.take(table, ids, axis=0)

  def attend(self, x: jax.Array) -> jax.Array:
    return jnp.einsum("bse,ve->bsv", x, jnp.asarray(self.embedding, self.dtype), preferred_element_type=jnp.float32)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotate x [batch, seq, heads, head_dim] by its positions [batch, seq].

  Uses the "rotate half" layout (first half of head_dim paired with the second half), which is
  the layout of Hugging Face Llama checkpoints, so their q/k weights need no permutation.
  """
  half = x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions[..., None].astype(jnp.float32) * freq  # [b, s, half]
  sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
