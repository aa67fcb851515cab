"""Llama-family decoder: embedding -> N x (RMSNorm, attention, RMSNorm, SwiGLU) -> RMSNorm -> logits."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxLite.config import Config
from MaxLite.layers.attention import Attention
from MaxLite.layers.embeddings import Embed
from MaxLite.layers.linears import DenseGeneral
from MaxLite.layers.mlp import MlpBlock
from MaxLite.layers.norms import RMSNorm
from MaxLite.layers.quantities import dtype_of

EMBED_ACTIVATION = ("activation_batch", "activation_length", "activation_embed")

_SAVE_NAMES = {
    "save_dot_except_mlp": ("query_proj", "key_proj", "value_proj", "out_proj"),
    "save_dot_except_mlpwi": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwo"),
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
    "save_out_proj": ("out_proj",),
}


def remat_policy(name: str) -> Any:
  """The jax.checkpoint policy for a remat_policy name ("full" saves nothing, recomputes all)."""
  if name == "full":
    return None
  if name == "minimal":
    return jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
  return jax.checkpoint_policies.save_only_these_names(*_SAVE_NAMES[name])


class DecoderLayer(nn.Module):
  config: Config
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
    cfg = self.config
    norm = dict(epsilon=cfg.normalization_layer_epsilon, dtype=dtype_of(cfg.dtype),
                weight_dtype=dtype_of(cfg.weight_dtype))
    x = nn.with_logical_constraint(x, EMBED_ACTIVATION)
    h = RMSNorm(name="pre_self_attention_norm", **norm)(x)
    h = Attention(cfg, name="self_attention")(h, segment_ids, positions)
    x = x + nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(h, deterministic=self.deterministic)
    h = RMSNorm(name="post_self_attention_norm", **norm)(x)
    h = MlpBlock(cfg, name="mlp")(h)
    x = x + nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(h, deterministic=self.deterministic)
    return nn.with_logical_constraint(x, EMBED_ACTIVATION), None


class Decoder(nn.Module):
  """The layer stack: scanned (one traced layer, params stacked on a leading `layers` axis) or unrolled."""

  config: Config
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
    cfg = self.config
    layer = DecoderLayer
    if cfg.remat_policy != "none":
      layer = nn.remat(layer, policy=remat_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
      stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                      in_axes=(nn.broadcast, nn.broadcast), length=cfg.base_num_decoder_layers,
                      metadata_params={nn.PARTITION_NAME: "layers"})
      x, _ = stack(cfg, self.deterministic, name="layers")(x, segment_ids, positions)
      return x
    for i in range(cfg.base_num_decoder_layers):
      x, _ = layer(cfg, self.deterministic, name=f"layers_{i}")(x, segment_ids, positions)
    return x


class Transformer(nn.Module):
  """Token ids [batch, seq] -> logits [batch, seq, vocab] (in the activation dtype)."""

  config: Config
  deterministic: bool = True

  @nn.compact
  def __call__(self, ids: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    cfg = self.config
    dtype, wdtype = dtype_of(cfg.dtype), dtype_of(cfg.weight_dtype)
    embed = Embed(cfg.vocab_size, cfg.base_emb_dim, dtype=dtype, weight_dtype=wdtype, name="token_embedder")
    x = nn.with_logical_constraint(embed(ids), EMBED_ACTIVATION)
    x = Decoder(cfg, self.deterministic, name="decoder")(x, segment_ids, positions)
    x = RMSNorm(cfg.normalization_layer_epsilon, dtype, wdtype, name="decoder_norm")(x)
    if cfg.logits_via_embedding:
      logits = embed.attend(x)
    else:
      logits = DenseGeneral(cfg.vocab_size, ("embed", "vocab"), dtype=dtype, weight_dtype=wdtype,
                            init_scale=cfg.param_init_scale, name="logits_dense")(x)
    return nn.with_logical_constraint(logits, ("activation_batch", "activation_length", "activation_vocab"))


def stack_layers(params: dict) -> dict:
  """Unscanned params (decoder/layers_i) -> scanned layout (decoder/layers, leading layer axis)."""
  decoder = dict(params["decoder"])
  names = sorted((k for k in decoder if k.startswith("layers_")), key=lambda k: int(k.split("_")[1]))
  layers = [decoder.pop(k) for k in names]
  decoder["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  return {**params, "decoder": decoder}


def unstack_layers(params: dict) -> dict:
  """Scanned params -> unscanned layout (decoder/layers_0 ... layers_{N-1})."""
  decoder = dict(params["decoder"])
  stacked = decoder.pop("layers")
  n = jax.tree.leaves(stacked)[0].shape[0]
  for i in range(n):
    decoder[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
  return {**params, "decoder": decoder}
