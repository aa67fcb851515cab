"""SwiGLU feed-forward block (Shazeer 2020), as in Llama."""

from __future__ import annotations

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

from MaxLite.config import Config
from MaxLite.layers.linears import DenseGeneral
from MaxLite.layers.quantities import dtype_of


class MlpBlock(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    kw = dict(dtype=dtype_of(cfg.dtype), weight_dtype=dtype_of(cfg.weight_dtype), init_scale=cfg.dense_init_scale)
    gate = DenseGeneral(cfg.base_mlp_dim, ("embed", "mlp"), name="wi_0", **kw)(x)
    up = DenseGeneral(cfg.base_mlp_dim, ("embed", "mlp"), name="wi_1", **kw)(x)
    hidden = checkpoint_name(nn.silu(gate) * up, "mlpwi")
    hidden = nn.with_logical_constraint(hidden, ("activation_batch", "activation_length", "activation_mlp"))
    out = DenseGeneral(cfg.base_emb_dim, ("mlp", "embed"), name="wo", **kw)(hidden)
    return checkpoint_name(out, "mlpwo")
