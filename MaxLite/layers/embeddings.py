"""Token embedding (RoPE is in rope.py)."""

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
  # MaxText's use_iota_embed: the lookup as a one-hot matmul, so its gradient is a matmul into the table instead of
  # a scatter-add (2 x tokens x vocab x embed FLOPs each way: worth it where the scatter is slow and the vocabulary
  # small; measure before choosing it for a 128K vocabulary).
  iota: bool = False

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
    if self.iota:
      one_hot = (ids[..., None] == jnp.arange(self.num_embeddings, dtype=ids.dtype)).astype(self.dtype)
      return jnp.einsum("bsv,ve->bse", one_hot, table)
    return jnp.take(table, ids, axis=0)

  def attend(self, x: jax.Array, logits_dtype: DType | None) -> jax.Array:
    table = jnp.asarray(self.embedding, self.dtype)
    return jnp.einsum("bse,ve->bsv", x, table, preferred_element_type=logits_dtype)
