"""SwiGLU feed-forward block (Shazeer 2020), as in Llama, optionally a part of the tokens at a time.

The MLP is the only part of a layer that works on each token alone, and its [tokens, mlp] activations (gate, up,
their product and the gradients of all three) are the largest buffers of a layer's backward pass. With
`mlp_chunks` = n > 1 the block (and the layer's pre-MLP RMSNorm) runs on 1/n of the tokens at a time, each part under
jax.checkpoint inside a scan, so the backward pass holds one part's activations instead of all of them. No matmul
is added: the layer's own rematerialisation drops the block's forward pass (nothing in the layer's backward needs its
output). The price is communication: under FSDP the weights are all-gathered, and their gradients reduce-scattered,
inside the loop over parts, once per part. Part i is the i-th run of consecutive tokens of every sequence shard.
"""

from __future__ import annotations

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

from MaxLite.config import Config
from MaxLite.layers.linears import DenseGeneral
from MaxLite.layers.quantities import dtype_of
from MaxLite.layers.remat import remat_policy

HIDDEN = ("activation_batch", "activation_length", "activation_mlp")
EMBED = ("activation_batch", "activation_length", "activation_embed")


class MlpBlock(nn.Module):
  """SwiGLU of norm(x) when a norm is given: the layer's pre-MLP RMSNorm (its parameters stay the layer's) is then
  made a part at a time too, so its float32 copy of the residual stream is one part's as well."""

  config: Config
  norm: nn.Module | None = None

  def setup(self):
    cfg = self.config
    kw = dict(dtype=dtype_of(cfg.dtype), weight_dtype=dtype_of(cfg.weight_dtype), init_scale=cfg.dense_init_scale)
    if cfg.fused_mlp:  # gate and up from one [embed, 2, mlp] kernel: one matmul, one read of x
      self.wi = DenseGeneral((2, cfg.base_mlp_dim), ("embed", "num_activations", "mlp"), **kw)
    else:
      self.wi_0 = DenseGeneral(cfg.base_mlp_dim, ("embed", "mlp"), **kw)
      self.wi_1 = DenseGeneral(cfg.base_mlp_dim, ("embed", "mlp"), **kw)
    self.wo = DenseGeneral(cfg.base_emb_dim, ("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    n, shards, (b, s, e) = self.config.mlp_chunks, self.config.sequence_shards, x.shape
    if n == 1 or s % (n * shards) or self.is_initializing():  # decoding (one token a step) runs the whole block
      return self.swiglu(x)
    # [b, shards, n, s / (shards n), e]: part i is the i-th run of consecutive tokens of every sequence shard, so a
    # split sequence stays split (and llama2-7b on v5p-8 needs 0.25 GiB less than with every n-th token as a part).
    parts = x.reshape(b, shards, n, s // (shards * n), e)

    def one_part(block: MlpBlock, carry: None, x: jax.Array) -> tuple[None, jax.Array]:
      *lead, c, e = x.shape  # [b, shards, c, e] -> [b, shards * c, e]: the MLP sees ordinary [batch, seq, embed] rows
      return carry, block.swiglu(x.reshape(b, shards * c, e)).reshape(*lead, c, e)

    # The layer's own remat policy inside: a policy that keeps the MLP's activations keeps them part by part.
    one_part = nn.remat(one_part, policy=remat_policy(self.config), prevent_cse=False)
    scan = nn.scan(one_part, variable_broadcast="params", split_rngs={"params": False}, in_axes=2, out_axes=2, length=n)
    _, out = scan(self, None, parts)
    return nn.with_logical_constraint(out.reshape(b, s, e), EMBED)

  def swiglu(self, x: jax.Array) -> jax.Array:
    if self.norm is not None:
      x = self.norm(x)
    if self.config.fused_mlp:
      both = checkpoint_name(nn.with_logical_constraint(self.wi(x), (*HIDDEN[:2], None, HIDDEN[2])), "mlpwi")
      gate, up = both[:, :, 0], both[:, :, 1]
    else:
      gate = checkpoint_name(nn.with_logical_constraint(self.wi_0(x), HIDDEN), "mlpwi_0")
      up = checkpoint_name(nn.with_logical_constraint(self.wi_1(x), HIDDEN), "mlpwi_1")
    hidden = nn.with_logical_constraint(nn.silu(gate) * up, HIDDEN)
    # Constrained before it is named, so a saved copy is the shard activation_embed gives it (see attention.py).
    out = nn.with_logical_constraint(self.wo(hidden), EMBED)
    return checkpoint_name(out, "mlpwo")
