"""The Llama-shaped decoder (MaxText's `llama2` block; `mistral` is the same block): pre-norm attention and a SwiGLU
MLP (or a MoE block), RMSNorm, RoPE. Llama 2/3/3.1, Mistral, Mixtral, Qwen 2.5 and Qwen 3 (dense and MoE) are
settings of it; their Hugging Face maps are in models/hf_layout.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

from MaxLite.cli.errors import ConfigError
from MaxLite.config import Config, families
from MaxLite.layers.attention import Attention
from MaxLite.layers.mlp import MlpBlock
from MaxLite.layers.moe import MoeBlock
from MaxLite.layers.norms import RMSNorm
from MaxLite.layers.quantities import dtype_of
from MaxLite.models import flops, hf_layout
from MaxLite.parallel.sharding import EMBED_ACTIVATION


class LlamaLayer(nn.Module):
  config: Config
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(
    self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, layer_index: Any = None
  ) -> tuple[jax.Array, Any]:
    """Returns (x, aux): aux is the MoE routing statistics of this layer, None for a dense layer."""
    del layer_index  # every layer is the same
    cfg = self.config
    norm = dict(
      epsilon=cfg.normalization_layer_epsilon, dtype=dtype_of(cfg.dtype), weight_dtype=dtype_of(cfg.weight_dtype)
    )
    x = checkpoint_name(nn.with_logical_constraint(x, EMBED_ACTIVATION), "decoder_layer_input")
    h = RMSNorm(name="pre_self_attention_norm", **norm)(x)
    h = Attention(cfg, self.decode, name="self_attention")(h, positions, segment_ids)
    x = x + nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(h, deterministic=self.deterministic)
    post_norm = RMSNorm(name="post_self_attention_norm", **norm)
    aux = None
    if cfg.num_experts > 1:
      h, aux = MoeBlock(cfg, name="moe")(post_norm(x), segment_ids != 0)
    else:
      h = MlpBlock(cfg, norm=post_norm, name="mlp")(x)
    x = x + nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(h, deterministic=self.deterministic)
    return nn.with_logical_constraint(x, EMBED_ACTIVATION), aux


def moe_mlp_dim(c: Mapping[str, Any]) -> int:
  return c["base_moe_mlp_dim"] if c["base_moe_mlp_dim"] > 0 else c["base_mlp_dim"]


def attention_parameters(c: Mapping[str, Any]) -> int:
  """q, k, v, out projections, their biases (attention_bias: q/k/v only) and the q/k norms."""
  emb, d, q, kv = c["base_emb_dim"], c["head_dim"], c["base_num_query_heads"], c["base_num_kv_heads"]
  return emb * d * (2 * q + 2 * kv) + c["attention_bias"] * d * (q + 2 * kv) + c["use_qk_norm"] * 2 * d


def parameter_count(c: Mapping[str, Any]) -> int:
  """Exact number of parameters of the decoder (tested against the real model and transformers' own)."""
  emb, mlp, vocab, experts = c["base_emb_dim"], c["base_mlp_dim"], c["vocab_size"], c["num_experts"]
  mlp_params = 3 * emb * mlp if experts == 1 else experts * 3 * emb * moe_mlp_dim(c) + emb * experts  # + router
  per_layer = attention_parameters(c) + mlp_params + 2 * emb
  head = 0 if c["logits_via_embedding"] else emb * vocab
  return vocab * emb + c["base_num_decoder_layers"] * per_layer + emb + head


def refuse_shared_experts(c: Mapping[str, Any]) -> None:
  if c["shared_experts"] > 0:
    raise ConfigError(
      f"shared_experts={c['shared_experts']}: decoder_block={c['decoder_block']} has no shared experts "
      "(decoder_block=deepseek has); use 0"
    )


def check(c: Mapping[str, Any]) -> None:
  refuse_shared_experts(c)
  if c["mlp_activations"][0] != "silu" and c["num_experts"] > 1:
    raise ConfigError(f"mlp_activations={c['mlp_activations']}: MoE experts are SwiGLU; use ['silu', 'linear']")


families.register(
  families.Family(
    decoder_blocks=("llama2", "mistral"),
    layer=LlamaLayer,
    parameter_count=parameter_count,
    training_flops=flops.decoder_flops,
    check=check,
    hf=families.HfLayout(
      architectures=hf_layout.ARCHITECTURES,
      settings=hf_layout.model_settings_from_hf,
      config=hf_layout.hf_config_from_model,
      layer_tensors=lambda config, layer: hf_layout.layer_tensors(config),
      global_tensors=lambda config: hf_layout.global_tensors(config.logits_via_embedding),
    ),
  )
)
