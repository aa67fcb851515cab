"""Gated feed-forward block, SwiGLU (Shazeer 2020) as in Llama or GeGLU as in Gemma, optionally a part of the
tokens at a time.

The MLP is the only part of a layer that works on each token alone, and its [tokens, mlp] activations (gate, up,
their product and the gradients of all three) are the largest buffers of a layer's backward pass. With
`mlp_chunks` = n > 1 the block (and the layer's pre-MLP RMSNorm) runs on 1/n of the tokens at a time, each part under
jax.checkpoint inside a scan, so the backward pass holds one part's activations instead of all of them. Part i is
the i-th run of consecutive tokens of every sequence shard. No matmul is added: the layer's own rematerialisation
drops the block's forward pass (nothing in the layer's backward needs its output).

Communication stays once per layer, as without parts: the weights are gathered (in the compute dtype) before the
loop, and given a leading dimension per token shard ([token shards, embed, mlp], one whole copy per device, no copying
between devices). Each device's weight gradient then adds up locally over the parts, and the sum over token shards, a
reduce-scatter into the weights' own sharding, runs once after the loop. With the plain [embed, mlp] weights inside
the loop, XLA gathers them and reduce-scatters their gradients once per part. The price is memory: the copies and
the summed gradients hold a layer's whole MLP weights twice over, so parts pay off where a layer's MLP activations
per device are larger than its MLP weights (llama2-7b at 16k tokens per device: -1.1 GiB; the v5e 64B recipe: +1.0).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxLite.config import Config
from MaxLite.layers.linears import DenseGeneral, cast_weight, quantized_base
from MaxLite.layers.norms import rms_norm
from MaxLite.layers.quantities import dtype_of
from MaxLite.layers.remat import remat_policy
from MaxLite.parallel.sharding import EMBED_ACTIVATION

HIDDEN = ("activation_batch", "activation_length", "activation_mlp")
# A part's tokens grouped by the shard that holds them: [batch shards, batch / shards, sequence shards, tokens, ...].
GROUPED = ("activation_batch", None, "activation_length", None)
SHARD_COPIES = ("activation_batch", "activation_length")  # the leading dims of the per-shard weight copies


def gate_activation(cfg: Config) -> Any:
  """mlp_activations[0]: silu (SwiGLU) or gelu, tanh-approximated (GeGLU: Gemma's gelu_pytorch_tanh)."""
  return nn.silu if cfg.mlp_activations[0] == "silu" else functools.partial(nn.gelu, approximate=True)


class MlpBlock(nn.Module):
  """SwiGLU of norm(x) when a norm is given: the layer's pre-MLP RMSNorm (its parameters stay the layer's) is then
  made a part at a time too, so its float32 copy of the residual stream is one part's as well."""

  config: Config
  norm: nn.Module | None = None
  width: int = 0  # the hidden width; 0 = base_mlp_dim (DeepSeek's shared experts and dense layers set their own)

  def setup(self):
    cfg = self.config
    width = self.width or cfg.base_mlp_dim
    kw = dict(
      dtype=dtype_of(cfg.dtype),
      weight_dtype=dtype_of(cfg.weight_dtype),
      init_scale=cfg.dense_init_scale,
      **quantized_base(cfg),
    )
    if cfg.fused_mlp:  # gate and up from one [embed, 2, mlp] kernel: one matmul, one read of x
      self.wi = DenseGeneral((2, width), ("embed", "num_activations", "mlp"), **kw)
    else:
      self.wi_0 = DenseGeneral(width, ("embed", "mlp"), **kw)
      self.wi_1 = DenseGeneral(width, ("embed", "mlp"), **kw)
    self.wo = DenseGeneral(cfg.base_emb_dim, ("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    cfg, (b, s, e) = self.config, x.shape
    n, batch_shards, seq_shards = cfg.mlp_chunks, cfg.activation_batch_shards, cfg.sequence_shards
    if n == 1 or s % (n * seq_shards) or b % batch_shards or self.is_initializing():  # decoding: the whole block
      return self.swiglu(x)
    c = s // (seq_shards * n)
    # [parts, batch shards, batch / shards, sequence shards, c, e]: every device's tokens of part i, in one slot.
    parts = x.reshape(batch_shards, b // batch_shards, seq_shards, n, c, e)
    parts = jnp.moveaxis(nn.with_logical_constraint(parts, (*GROUPED, None, "activation_embed")), 3, 0)
    weights = self._weights_per_shard(batch_shards, seq_shards)
    epsilon = self.norm.epsilon if self.norm is not None else None
    swiglu = functools.partial(_swiglu_part, fused=cfg.fused_mlp, epsilon=epsilon, act=gate_activation(cfg))
    one_part = jax.checkpoint(swiglu, policy=remat_policy(cfg), prevent_cse=False)

    def step(carry: None, part: jax.Array) -> tuple[None, jax.Array]:
      return carry, one_part(weights, part)

    _, out = jax.lax.scan(step, None, parts)
    return nn.with_logical_constraint(jnp.moveaxis(out, 0, 3).reshape(b, s, e), EMBED_ACTIVATION)

  def _weights_per_shard(self, batch_shards: int, seq_shards: int) -> dict[str, jax.Array]:
    """The block's weights in the compute dtype, whole over embed, one copy per token shard (see the docstring)."""
    dtype = dtype_of(self.config.dtype)
    names = ("wi", "wo") if self.config.fused_mlp else ("wi_0", "wi_1", "wo")
    weights = {}
    for name in names:
      dense: DenseGeneral = getattr(self, name)
      kernel = cast_weight(nn.unbox(dense.variables["params"]["kernel"]), dtype)
      axes = tuple("activation_mlp" if a == "mlp" else None for a in dense.logical_axes)  # whole over embed
      copies = jnp.broadcast_to(kernel, (batch_shards, seq_shards, *kernel.shape))
      weights[name] = nn.with_logical_constraint(copies, (*SHARD_COPIES, *axes))
    if self.norm is not None:
      weights["norm"] = nn.unbox(self.norm.variables["params"]["scale"])
    return weights

  def swiglu(self, x: jax.Array) -> jax.Array:
    if self.norm is not None:
      x = self.norm(x)
    if self.config.fused_mlp:
      both = checkpoint_name(nn.with_logical_constraint(self.wi(x), (*HIDDEN[:2], None, HIDDEN[2])), "mlpwi")
      gate, up = both[:, :, 0], both[:, :, 1]
    else:
      gate = checkpoint_name(nn.with_logical_constraint(self.wi_0(x), HIDDEN), "mlpwi_0")
      up = checkpoint_name(nn.with_logical_constraint(self.wi_1(x), HIDDEN), "mlpwi_1")
    hidden = nn.with_logical_constraint(gate_activation(self.config)(gate) * up, HIDDEN)
    # Constrained before it is named, so a saved copy is the shard activation_embed gives it (see attention.py).
    out = nn.with_logical_constraint(self.wo(hidden), EMBED_ACTIVATION)
    return checkpoint_name(out, "mlpwo")


def _swiglu_part(
  weights: dict[str, jax.Array], x: jax.Array, fused: bool, epsilon: float | None, act: Any
) -> jax.Array:
  """MlpBlock.swiglu on one part, x: [batch shards, batch / shards, sequence shards, c, embed], with the per-shard
  weight copies: every contraction is within a shard, so nothing here moves between devices but x's embed."""
  dtype = weights["wo"].dtype
  if "norm" in weights:
    x = rms_norm(x, weights["norm"], epsilon, dtype)
  x = jnp.asarray(x, dtype)
  hidden_axes = (*GROUPED, "activation_mlp")
  if fused:
    both = jnp.einsum("gbsce,gseam->gbscam", x, weights["wi"])
    both = checkpoint_name(nn.with_logical_constraint(both, (*GROUPED, None, "activation_mlp")), "mlpwi")
    gate, up = both[..., 0, :], both[..., 1, :]
  else:
    gate = jnp.einsum("gbsce,gsem->gbscm", x, weights["wi_0"])
    gate = checkpoint_name(nn.with_logical_constraint(gate, hidden_axes), "mlpwi_0")
    up = jnp.einsum("gbsce,gsem->gbscm", x, weights["wi_1"])
    up = checkpoint_name(nn.with_logical_constraint(up, hidden_axes), "mlpwi_1")
  hidden = nn.with_logical_constraint(act(gate) * up, hidden_axes)
  out = nn.with_logical_constraint(
    jnp.einsum("gbscm,gsme->gbsce", hidden, weights["wo"]), (*GROUPED, "activation_embed")
  )
  return checkpoint_name(out, "mlpwo")
