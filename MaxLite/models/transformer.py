"""The decoder: embedding -> N x the family's layer (by decoder_block) -> RMSNorm -> logits."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxLite.config import Config
from MaxLite.config.families import Family, family
from MaxLite.layers.attention import soft_cap
from MaxLite.layers.embeddings import Embed
from MaxLite.layers.linears import DenseGeneral
from MaxLite.layers.moe import load_balance_loss
from MaxLite.layers.norms import RMSNorm
from MaxLite.layers.pipeline import run_pipeline
from MaxLite.layers.quantities import dtype_of
from MaxLite.layers.remat import remat_policy
from MaxLite.parallel import context
from MaxLite.parallel.sharding import EMBED_ACTIVATION


class Decoder(nn.Module):
  """The layer stack: scanned (one traced layer, params stacked on a leading `layers` axis), unrolled,
  or pipelined over the `stage` mesh axis (same scanned parameters, split into stages).

  Returns (x, aux): MoE routing summary {lb_loss (mean over layers), dropped, routed}, or None.
  """

  config: Config
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, Any]:
    cfg = self.config
    family = decoder_family(cfg)
    layer = family.layer
    if cfg.remat_policy != "none" and not self.decode:  # decoding keeps no activations for a backward pass
      layer = nn.remat(layer, policy=remat_policy(cfg), prevent_cse=not cfg.scan_layers)
    stacks = family.stacks(cfg)
    if cfg.num_pipeline_stages > 1 and not self.is_initializing() and not self.decode:
      return self._pipeline(x, positions, segment_ids)
    auxes, depth = [], 0
    for stack in stacks:
      if not cfg.scan_layers:
        for i in range(stack.count):
          module = layer(cfg, self.deterministic, self.decode, name=f"{stack.name}_{i}", **stack.options)
          x, aux = module(x, positions, segment_ids, depth + i)
          auxes.append(None if aux is None else jax.tree.map(lambda a: a[None], aux))
      else:
        scanned = nn.scan(
          layer,
          variable_axes={"params": 0, "cache": 0},
          split_rngs={"params": True, "dropout": True},
          in_axes=(nn.broadcast, nn.broadcast, 0),
          length=stack.count,
          metadata_params={nn.PARTITION_NAME: "layers"},
        )
        module = scanned(cfg, self.deterministic, self.decode, name=stack.name, **stack.options)
        x, aux = module(x, positions, segment_ids, jnp.arange(depth, depth + stack.count))
        auxes.append(aux)
      depth += stack.count
    routed = [a for a in auxes if a is not None]  # [layers, ...] each; dense layers have none
    return x, summarize_routing(jax.tree.map(lambda *a: jnp.concatenate(a), *routed) if routed else None)

  def _pipeline(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, Any]:
    cfg = self.config

    # The parameters were created by the scanned stack above (so checkpoints are layout-independent);
    # here each layer is applied functionally to its slice of them.
    family = decoder_family(cfg)
    (stack,) = family.stacks(cfg)  # the family's check allows pipelining only with one kind of layer
    layer = family.layer(cfg, self.deterministic, **stack.options)

    def layer_fn(params, h, pos, seg, depth, rng):
      return layer.apply({"params": params}, h, pos, seg, depth, rngs={"dropout": rng})

    if cfg.remat_policy != "none":
      layer_fn = jax.checkpoint(layer_fn, policy=remat_policy(cfg))
    rng = self.make_rng("dropout") if not self.deterministic else jax.random.key(0)
    x, aux = run_pipeline(
      layer_fn,
      self.variables["params"][stack.name],
      x,
      positions,
      segment_ids,
      rng,
      stages=cfg.num_pipeline_stages,
      microbatches=cfg.num_pipeline_microbatches,
    )
    return x, summarize_routing(aux)


def decoder_family(cfg: Config) -> Family:
  """The family registered for cfg.decoder_block (models/ registers them all when imported)."""
  return family(cfg.decoder_block)


def summarize_routing(per_layer: Any) -> Any:
  """Per-layer routing sums [layers, ...] -> {lb_loss (mean over layers), dropped, routed, and with a routing bias
  expert_counts [layers, experts]}; None stays None."""
  if per_layer is None:
    return None
  summary = {
    "lb_loss": jnp.mean(load_balance_loss(per_layer)),
    "dropped": jnp.sum(per_layer["dropped"]),
    "routed": jnp.sum(per_layer["routed"]),
  }
  if "expert_counts" in per_layer:  # [MoE layers, experts]: what DeepSeek's routing-bias update balances
    summary["expert_counts"] = per_layer["expert_counts"]
  return summary


class Transformer(nn.Module):
  """Token ids [batch, seq] -> logits [batch, seq, vocab] (matmul inputs in the activation dtype; the logits in
  float32 with logits_dot_in_fp32=true or a float32 dtype, else in the activation dtype, as in MaxText).

  return_hidden=True: (final hidden states [batch, seq, embed] in the activation dtype, output head [embed, vocab]
  in the weight dtype) instead, so the loss can make the logits a chunk of tokens at a time (num_vocab_tiling).
  decode=True: attention layers keep a KV cache (apply with mutable=["cache"]); see decode.py.
  """

  config: Config
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(
    self, ids: jax.Array, positions: jax.Array, segment_ids: jax.Array, return_hidden: bool = False
  ) -> jax.Array | tuple[jax.Array, jax.Array]:
    cfg = self.config
    dtype, wdtype = dtype_of(cfg.dtype), dtype_of(cfg.weight_dtype)
    # Context parallelism's load balancing: the layers see each shard's early and late tokens (parallel/context.py);
    # the final hidden states go back in order, so whatever reads the outputs sees the original sequence.
    order = None if self.decode else context.order_of(cfg, ids.shape[1])
    if order is not None:
      ids, positions, segment_ids = (context.reorder(a, order) for a in (ids, positions, segment_ids))
    embed = Embed(
      cfg.vocab_size, cfg.base_emb_dim, dtype=dtype, weight_dtype=wdtype, iota=cfg.use_iota_embed, name="token_embedder"
    )
    x = embed(ids)
    if decoder_family(cfg).scale_embeddings:  # Gemma: sqrt(width), rounded to the activation dtype
      x = x * jnp.asarray(cfg.base_emb_dim**0.5, x.dtype)
    x = nn.with_logical_constraint(x, EMBED_ACTIVATION)
    x, moe_aux = Decoder(cfg, self.deterministic, self.decode, name="decoder")(x, positions, segment_ids)
    if moe_aux is not None:
      self.sow("intermediates", "moe", moe_aux)  # read by the loss (apply with mutable="intermediates")
    if order is not None:
      x = nn.with_logical_constraint(context.restore(x, order), EMBED_ACTIVATION)
    offset = decoder_family(cfg).norm_scale_offset
    x = RMSNorm(cfg.normalization_layer_epsilon, dtype, wdtype, offset, name="decoder_norm")(x)
    if cfg.logits_via_embedding:
      if return_hidden:
        return x, self._head(embed.embedding.T)
      logits = embed.attend(x, logits_dtype(cfg))
    else:
      dense = DenseGeneral(
        cfg.vocab_size,
        ("embed", "vocab"),
        dtype=dtype,
        weight_dtype=wdtype,
        init_scale=cfg.dense_init_scale,
        output_dtype=logits_dtype(cfg),
        name="logits_dense",
      )
      if return_hidden and not self.is_initializing():
        return x, self._head(self.variables["params"]["logits_dense"]["kernel"])  # the weight `dense` applies
      logits = dense(x)
    logits = soft_cap(logits, cfg.final_logits_soft_cap)
    return nn.with_logical_constraint(logits, ("activation_batch", "activation_length", "activation_vocab"))

  def _head(self, weight: jax.Array) -> jax.Array:
    # In the weight dtype: the tiled loss casts it per chunk, so the chunks' gradients add up in that dtype.
    return nn.with_logical_constraint(weight, ("embed", "vocab"))


def logits_dtype(cfg: Config) -> Any:
  """float32 logits straight from the head's matmul (its bfloat16 inputs accumulated in float32), or None: the
  activation dtype, which the loss takes to float32. The head's gradient then comes in that dtype too: with float32
  logits it is a float32 [embed, vocab] buffer per device until its reduction (MaxText's v5e 64B recipe: 1.2 GiB
  more), but other configs need less memory with them (v5e 16B: 0.36 GiB less)."""
  return jnp.float32 if cfg.logits_dot_in_fp32 else None


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
