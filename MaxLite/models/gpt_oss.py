"""GPT-OSS (MaxText's `gpt_oss` block; OpenAI's gpt-oss-20b and -120b): pre-norm attention and a mixture of experts
in every layer, RMSNorm, YaRN RoPE. What it adds to a Llama-shaped MoE layer, asked of the shared layers as features:
- attention: sinks (attention_sink: a learned logit per query head in each softmax's denominator), biases on all four
  projections (attention_bias), and sliding-window (sliding_window_size) and full attention in alternate layers, the
  even ones sliding (transformers' layer_types, MaxText's GPT_OSS_ATTENTION_PATTERN);
- experts: a router with a bias (routed_bias, learned by its gradient), biases on every expert projection (mlp_bias)
  and a clamped gated unit: gate <= limit, -limit <= up <= limit, then gate * sigmoid(1.702 gate) * (up + 1)
  (mlp_activations_limit, MaxText's mlp_activations ['sigmoid', 'linear']), as transformers' GptOssExperts computes.
The router's softmax over the top-k logits is the softmax over all experts renormalised over the chosen k
(norm_topk_prob). Its keys are declared in models/gpt_oss_keys.py; its Hugging Face map is models/gpt_oss_hf.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxLite.cli.errors import ConfigError
from MaxLite.config import Config, families
from MaxLite.config.attention_choice import SINKS
from MaxLite.layers.attention import Attention, AttentionFeatures
from MaxLite.layers.moe import ExpertFeatures, MoeBlock
from MaxLite.layers.norms import RMSNorm
from MaxLite.layers.quantities import dtype_of
from MaxLite.models import flops, gpt_oss_hf
from MaxLite.models.llama import attention_parameters, moe_mlp_dim, refuse_shared_experts
from MaxLite.parallel.sharding import EMBED_ACTIVATION

ALPHA = 1.702  # the gated unit's sigmoid gain (transformers' swiglu_alpha; fixed in MaxText)
ACTIVATIONS = ("sigmoid", "linear")  # MaxText's spelling of that unit


def is_sliding(layer_index: Any) -> Any:
  """Layers 0, 2, 4, ... attend within the window, 1, 3, 5, ... over the whole sequence (traced under nn.scan)."""
  return layer_index % 2 == 0


@dataclasses.dataclass(frozen=True)
class ClampedGate:
  """gate * sigmoid(alpha gate) * (up + 1), gate clamped above at `limit`, up to [-limit, limit] (limit <= 0: none).
  A frozen dataclass, not a closure: flax compares module fields, and two equal units are then one."""

  limit: float
  alpha: float = ALPHA

  def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    if self.limit > 0:
      gate, up = jnp.minimum(gate, self.limit), jnp.clip(up, -self.limit, self.limit)
    return gate * jax.nn.sigmoid(gate * jnp.asarray(self.alpha, gate.dtype)) * (up + 1)


def features(cfg: Any) -> tuple[AttentionFeatures, ExpertFeatures]:
  """What this family asks of the shared attention and MoE layers, from its keys."""
  attention = AttentionFeatures(sinks=cfg.attention_sink, out_bias=cfg.attention_bias)
  experts = ExpertFeatures(
    router_bias=cfg.routed_bias, expert_bias=cfg.mlp_bias, gated=ClampedGate(cfg.mlp_activations_limit)
  )
  return attention, experts


class GptOssLayer(nn.Module):
  config: Config
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, layer_index: Any) -> tuple:
    cfg = self.config
    norm = dict(
      epsilon=cfg.normalization_layer_epsilon, dtype=dtype_of(cfg.dtype), weight_dtype=dtype_of(cfg.weight_dtype)
    )
    dropout = lambda h: nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(h, deterministic=self.deterministic)
    attention_features, expert_features = features(cfg)
    x = checkpoint_name(nn.with_logical_constraint(x, EMBED_ACTIVATION), "decoder_layer_input")
    h = RMSNorm(name="pre_self_attention_norm", **norm)(x)
    h = Attention(cfg, self.decode, features=attention_features, name="self_attention")(
      h, positions, segment_ids, sliding=is_sliding(layer_index)
    )
    x = x + dropout(h)
    h = RMSNorm(name="post_self_attention_norm", **norm)(x)
    y, aux = MoeBlock(cfg, features=expert_features, name="moe")(h, segment_ids != 0)
    x = x + dropout(y)
    return nn.with_logical_constraint(x, EMBED_ACTIVATION), aux


def parameter_count(c: Mapping[str, Any]) -> int:
  """Exact: attention (with the output projection's bias and the sinks), router (and its bias), experts (and their
  biases), two norms per layer, embedding, final norm, head."""
  emb, vocab, experts, width = c["base_emb_dim"], c["vocab_size"], c["num_experts"], moe_mlp_dim(c)
  attention = attention_parameters(c) + c["attention_bias"] * emb + c["attention_sink"] * c["base_num_query_heads"]
  router = emb * experts + c["routed_bias"] * experts
  expert = 3 * emb * width + c["mlp_bias"] * (2 * width + emb)
  per_layer = attention + router + experts * expert + 2 * emb
  head = 0 if c["logits_via_embedding"] else emb * vocab
  return vocab * emb + c["base_num_decoder_layers"] * per_layer + emb + head


def training_flops(config: Config) -> dict[str, float]:
  """A full layer's query sees half the sequence on average, a sliding one at most sliding_window_size keys."""
  seq, window, layers = config.max_target_length, config.sliding_window_size, config.base_num_decoder_layers
  sliding = sum(bool(is_sliding(i)) for i in range(layers)) if window > 0 else 0
  sliding_keys = seq / 2 if window >= seq else window - window * window / (2 * seq)
  attended = (sliding * sliding_keys + (layers - sliding) * seq / 2) / layers
  return flops.decoder_flops(config, attended_keys=attended)


def attention_needs(c: Mapping[str, Any]) -> dict[str, str]:
  return {SINKS: "attention_sink=true"} if c["attention_sink"] else {}


def check(c: Mapping[str, Any]) -> None:
  refuse_shared_experts(c)
  if c["num_experts"] < 2:
    raise ConfigError(f"decoder_block=gpt_oss is a mixture of experts: num_experts={c['num_experts']} must be >= 2")
  if c["routed_score_func"] not in ("", "softmax") or not c["norm_topk_prob"] or c["n_routing_groups"] != -1:
    raise ConfigError(
      "decoder_block=gpt_oss routes by a softmax over each token's top-k logits: set routed_score_func='', "
      "norm_topk_prob=true, n_routing_groups=-1"
    )
  if c["routed_bias_update_rate"] != 0:
    raise ConfigError(
      f"routed_bias_update_rate={c['routed_bias_update_rate']}: decoder_block=gpt_oss's router bias (routed_bias) is "
      "learned by its gradient; use 0"
    )
  if c["first_num_dense_layers"] or c["attention_type"] != "global" or c["fused_qkv"]:
    raise ConfigError(
      "decoder_block=gpt_oss has a MoE in every layer and grouped-query attention: set first_num_dense_layers=0, "
      "attention_type=global, fused_qkv=false"
    )


families.register(
  families.Family(
    decoder_blocks=("gpt_oss",),
    layer=GptOssLayer,
    parameter_count=parameter_count,
    training_flops=training_flops,
    hf=families.HfLayout(
      architectures=("GptOssForCausalLM",),
      settings=gpt_oss_hf.settings_from_hf,
      config=gpt_oss_hf.hf_config,
      layer_tensors=gpt_oss_hf.layer_tensors,
      global_tensors=gpt_oss_hf.global_tensors,
      read=gpt_oss_hf.read,
    ),
    check=check,
    attention_needs=attention_needs,
    mlp_activations=(ACTIVATIONS,),
  )
)
