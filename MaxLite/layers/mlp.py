"""SwiGLU feed-forward block (Shazeer 2020), as in Llama."""

from __future__ import annotations

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

from MaxLite.config import Config
from MaxLite.layers.linears import DenseGeneral
from MaxLite.layers.quantities import dtype_of

HIDDEN = ("activation_batch", "activation_length", "activation_mlp")


class MlpBlock(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    kw = dict(dtype=dtype_of(cfg.dtype), weight_dtype=dtype_of(cfg.weight_dtype), init_scale=cfg.dense_init_scale)
    if cfg.fused_mlp:  # gate and up from one [embed, 2, mlp] kernel: one matmul, one read of x
      both = DenseGeneral((2, cfg.base_mlp_dim), ("embed", "num_activations", "mlp"), name="wi", **kw)(x)
      both = checkpoint_name(nn.with_logical_constraint(both, (*HIDDEN[:2], None, HIDDEN[2])), "mlpwi")
      gate, up = both[:, :, 0], both[:, :, 1]
    else:
      gate = DenseGeneral(cfg.base_mlp_dim, ("embed", "mlp"), name="wi_0", **kw)(x)
      up = DenseGeneral(cfg.base_mlp_dim, ("embed", "mlp"), name="wi_1", **kw)(x)
      gate = checkpoint_name(nn.with_logical_constraint(gate, HIDDEN), "mlpwi_0")
      up = checkpoint_name(nn.with_logical_constraint(up, HIDDEN), "mlpwi_1")
    hidden = nn.with_logical_constraint(nn.silu(gate) * up, HIDDEN)
    out = DenseGeneral(cfg.base_emb_dim, ("mlp", "embed"), name="wo", **kw)(hidden)
    # Constrained before it is named, so a saved copy is the shard activation_embed gives it (see attention.py).
    out = nn.with_logical_constraint(out, ("activation_batch", "activation_length", "activation_embed"))
    return checkpoint_name(out, "mlpwo")
