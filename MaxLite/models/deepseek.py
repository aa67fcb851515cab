"""DeepSeek-V3 (MaxText's `deepseek` block): multi-head latent attention (layers/mla.py), the first
first_num_dense_layers layers with a dense SwiGLU MLP and the rest mixture-of-experts with shared experts, routed by
sigmoid scores with a bias for the choice (auxiliary-loss-free balancing: train_step moves it by
routed_bias_update_rate each step), grouped top-k and scaled weights; YaRN RoPE.

The dense and the MoE layers are two scanned stacks (decoder/dense_layers, decoder/moe_layers), as in MaxText.
Multi-token prediction (mtp_num_layers) is not built: transformers' DeepseekV3ForCausalLM has none either.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

from MaxLite.cli.errors import ConfigError
from MaxLite.config import Config, families
from MaxLite.layers.attention import Attention
from MaxLite.layers.mla import MlaAttention
from MaxLite.layers.mlp import MlpBlock
from MaxLite.layers.moe import MoeBlock
from MaxLite.layers.norms import RMSNorm
from MaxLite.layers.quantities import dtype_of
from MaxLite.models import deepseek_hf, hf_layout
from MaxLite.models.llama import attention_parameters, moe_mlp_dim
from MaxLite.parallel.sharding import EMBED_ACTIVATION


class DeepSeekLayer(nn.Module):
  config: Config
  deterministic: bool = True
  decode: bool = False
  moe: bool = True

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, layer_index: Any) -> tuple:
    del layer_index
    cfg = self.config
    norm = dict(
      epsilon=cfg.normalization_layer_epsilon, dtype=dtype_of(cfg.dtype), weight_dtype=dtype_of(cfg.weight_dtype)
    )
    dropout = lambda h: nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(h, deterministic=self.deterministic)
    x = checkpoint_name(nn.with_logical_constraint(x, EMBED_ACTIVATION), "decoder_layer_input")
    h = RMSNorm(name="pre_self_attention_norm", **norm)(x)
    attention = MlaAttention if cfg.attention_type == "mla" else Attention
    x = x + dropout(attention(cfg, self.decode, name="self_attention")(h, positions, segment_ids))
    h = RMSNorm(name="post_self_attention_norm", **norm)(x)
    aux = None
    if self.moe:
      y, aux = MoeBlock(cfg, name="moe")(h, segment_ids != 0)
      if cfg.shared_experts > 0:
        y = y + MlpBlock(cfg, width=cfg.shared_experts * cfg.moe_mlp_dim, name="shared_experts")(h)
    else:
      y = MlpBlock(cfg, name="mlp")(h)
    x = x + dropout(y)
    return nn.with_logical_constraint(x, EMBED_ACTIVATION), aux


def stacks(config: Any) -> tuple[families.Stack, ...]:
  dense = config.first_num_dense_layers
  moe = families.Stack("moe_layers", config.base_num_decoder_layers - dense, {"moe": True})
  return ((families.Stack("dense_layers", dense, {"moe": False}),) if dense else ()) + (moe,)


def _mla_parameters(c: Mapping[str, Any]) -> int:
  emb, heads, rq, rkv = c["base_emb_dim"], c["base_num_query_heads"], c["q_lora_rank"], c["kv_lora_rank"]
  dq = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
  q = emb * rq + rq + rq * heads * dq if rq > 0 else emb * heads * dq
  kv = emb * (rkv + c["qk_rope_head_dim"]) + rkv + rkv * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
  return q + kv + heads * c["v_head_dim"] * emb


def parameter_count(c: Mapping[str, Any]) -> int:
  """The routing bias (routed_bias) counts: it is a parameter here (transformers keeps it as a buffer)."""
  emb, vocab, experts, width = c["base_emb_dim"], c["vocab_size"], c["num_experts"], moe_mlp_dim(c)
  attention = _mla_parameters(c) if c["attention_type"] == "mla" else attention_parameters(c)
  dense = attention + 3 * emb * c["base_mlp_dim"] + 2 * emb
  moe = attention + 3 * emb * width * (experts + c["shared_experts"]) + emb * experts + 2 * emb
  moe += experts * c["routed_bias"]
  layers, first = c["base_num_decoder_layers"], c["first_num_dense_layers"]
  head = 0 if c["logits_via_embedding"] else emb * vocab
  return vocab * emb + first * dense + (layers - first) * moe + emb + head


def training_flops(config: Config) -> dict[str, float]:
  """Model FLOPs as models/flops.py counts them: 2 per multiply-add, x3 for training, causal attention at half."""
  tokens = config.global_batch_size_to_train_on * config.max_target_length
  emb, heads, seq = config.base_emb_dim, config.base_num_query_heads, config.max_target_length
  if config.attention_type == "mla":
    nope, rope, dv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    rq, rkv = config.q_lora_rank, config.kv_lora_rank
    q = emb * rq + rq * heads * (nope + rope) if rq > 0 else emb * heads * (nope + rope)
    projections = q + emb * (rkv + rope) + rkv * heads * (nope + dv) + heads * dv * emb
    attention = seq / 2 * heads * (nope + rope + dv)
  else:
    d, kv = config.head_dim, config.base_num_kv_heads
    projections = emb * d * (2 * heads + 2 * kv)
    attention = seq / 2 * heads * 2 * d
  width, k = config.moe_mlp_dim, config.num_experts_per_tok
  experts = 3 * emb * width * k
  moe_mlp = experts + 3 * emb * width * config.shared_experts + emb * config.num_experts
  first, layers = config.first_num_dense_layers, config.base_num_decoder_layers
  weights = layers * projections + first * 3 * emb * config.base_mlp_dim + (layers - first) * moe_mlp
  weights += emb * config.vocab_size
  out = {
    "weights": 3 * 2 * tokens * weights,
    "attention": 3 * 2 * tokens * layers * attention,
    "experts": 3 * 2 * tokens * (layers - first) * experts,
  }
  return {**{k: float(v) for k, v in out.items()}, "total": float(out["weights"] + out["attention"])}


def check(c: Mapping[str, Any]) -> None:
  experts, groups, best = c["num_experts"], c["n_routing_groups"], c["topk_routing_group"]
  if experts < 2:
    raise ConfigError(f"decoder_block=deepseek is a mixture of experts: num_experts={experts} must be >= 2")
  if not 0 <= c["first_num_dense_layers"] < c["base_num_decoder_layers"]:
    raise ConfigError(
      f"first_num_dense_layers={c['first_num_dense_layers']} must be in [0, base_num_decoder_layers="
      f"{c['base_num_decoder_layers']})"
    )
  if c["routed_score_func"] not in ("", "softmax", "sigmoid"):
    raise ConfigError(f"routed_score_func={c['routed_score_func']!r} is not one of: '', 'softmax', 'sigmoid'")
  if c["attention_type"] not in ("global", "mla"):
    raise ConfigError(f"attention_type={c['attention_type']!r} is not one of: 'global', 'mla'")
  if groups != -1 and not (groups >= 1 and experts % groups == 0 and experts // groups >= 2 and 1 <= best <= groups):
    raise ConfigError(
      f"n_routing_groups={groups} must divide num_experts={experts} into groups of >= 2 experts, with 1 <= "
      f"topk_routing_group={best} <= n_routing_groups (or n_routing_groups=-1: no groups)"
    )
  if c["first_num_dense_layers"] and (c["ici_pipeline_parallelism"] > 1 or c["dcn_pipeline_parallelism"] > 1):
    raise ConfigError("pipeline parallelism needs one kind of layer; set first_num_dense_layers=0 or pipeline 1")
  if c["attention_type"] == "mla" and (c["fused_qkv"] or c["sliding_window_size"]):
    raise ConfigError("attention_type=mla needs fused_qkv=false and sliding_window_size=0")


# ---------------------------------------------------------------- Hugging Face (DeepseekV3ForCausalLM)


families.register(
  families.Family(
    decoder_blocks=("deepseek",),
    layer=DeepSeekLayer,
    parameter_count=parameter_count,
    training_flops=training_flops,
    hf=families.HfLayout(
      architectures=("DeepseekV3ForCausalLM",),
      settings=deepseek_hf.settings_from_hf,
      config=deepseek_hf.hf_config,
      layer_tensors=deepseek_hf.layer_tensors,
      global_tensors=lambda config: hf_layout.global_tensors(config.logits_via_embedding),
    ),
    check=check,
    stacks=stacks,
  )
)
