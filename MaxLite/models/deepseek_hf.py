"""DeepSeek-V3's Hugging Face map: transformers' DeepseekV3 config.json <-> MaxLite's keys, and each layer's tensors
(MLA's latent projections, RoPE rows permuted from transformers' interleaved pairs, dense and routed experts, the
routing bias). Its own module because it is as long as the family's model code (models/deepseek.py registers it)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from MaxLite.cli.errors import InputError
from MaxLite.layers.rope import hf_yarn_attention_factor, yarn_attention_factor, yarn_mscale
from MaxLite.models import hf_layout
from MaxLite.models.hf_layout import Tensor


def _rope_rows_last(n: int) -> tuple[np.ndarray, np.ndarray]:
  """(to rotate-half order, back): transformers rotates interleaved pairs of the last n RoPE features; MaxLite the
  two halves. Permuting those weight rows once (evens, then odds) makes one the other."""
  order = np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])
  return order, np.argsort(order)


def _heads(rows_in: int, heads: int, width: int, rope: int = 0) -> tuple:
  """HF [heads * width, rows_in] <-> MaxLite kernel [rows_in, heads, width]; the last `rope` of each head's width
  permuted (see _rope_rows_last)."""
  to, back = _rope_rows_last(rope)
  order = np.concatenate([np.arange(width - rope), width - rope + to])
  inverse = np.concatenate([np.arange(width - rope), width - rope + back])
  return (
    lambda w: w.T.reshape(rows_in, heads, width)[..., order],
    lambda k: k[..., inverse].reshape(rows_in, heads * width).T,
  )


_SAME = (lambda w: w, lambda k: k)
_T = (lambda w: w.T, lambda k: k.T)


def layer_tensors(config: Any, layer: int) -> list[Tensor]:
  emb, heads, nope, rope = (
    config.base_emb_dim,
    config.base_num_query_heads,
    config.qk_nope_head_dim,
    config.qk_rope_head_dim,
  )
  rq, rkv, dv = config.q_lora_rank, config.kv_lora_rank, config.v_head_dim
  to, back = _rope_rows_last(rope)
  latent_order = np.concatenate([np.arange(rkv), rkv + to])
  latent_inverse = np.concatenate([np.arange(rkv), rkv + back])
  out = [
    Tensor("pre_self_attention_norm/scale", "input_layernorm.weight", *_SAME),
    Tensor("post_self_attention_norm/scale", "post_attention_layernorm.weight", *_SAME),
    Tensor(
      "self_attention/wkv_a/kernel",
      "self_attn.kv_a_proj_with_mqa.weight",
      lambda w: w.T[:, latent_order],
      lambda k: k[:, latent_inverse].T,
    ),
    Tensor("self_attention/kv_norm/scale", "self_attn.kv_a_layernorm.weight", *_SAME),
    Tensor("self_attention/wkv_b/kernel", "self_attn.kv_b_proj.weight", *_heads(rkv, heads, nope + dv)),
    Tensor(
      "self_attention/out/kernel",
      "self_attn.o_proj.weight",
      lambda w: w.T.reshape(heads, dv, emb),
      lambda k: k.reshape(heads * dv, emb).T,
    ),
  ]
  if rq > 0:
    out += [
      Tensor("self_attention/wq_a/kernel", "self_attn.q_a_proj.weight", *_T),
      Tensor("self_attention/q_norm/scale", "self_attn.q_a_layernorm.weight", *_SAME),
      Tensor("self_attention/wq_b/kernel", "self_attn.q_b_proj.weight", *_heads(rq, heads, nope + rope, rope)),
    ]
  else:
    out.append(Tensor("self_attention/query/kernel", "self_attn.q_proj.weight", *_heads(emb, heads, nope + rope, rope)))
  if layer < config.first_num_dense_layers:
    return out + [
      Tensor("mlp/wi_0/kernel", "mlp.gate_proj.weight", *_T),
      Tensor("mlp/wi_1/kernel", "mlp.up_proj.weight", *_T),
      Tensor("mlp/wo/kernel", "mlp.down_proj.weight", *_T),
    ]
  out += [
    Tensor("moe/gate/kernel", "mlp.gate.weight", *_T),
    Tensor("moe/wi_0", "mlp.experts.{e}.gate_proj.weight", *_T),
    Tensor("moe/wi_1", "mlp.experts.{e}.up_proj.weight", *_T),
    Tensor("moe/wo", "mlp.experts.{e}.down_proj.weight", *_T),
  ]
  if config.routed_bias:
    out.append(Tensor("moe/score_correction_bias", "mlp.gate.e_score_correction_bias", *_SAME))
  if config.shared_experts:
    out += [
      Tensor("shared_experts/wi_0/kernel", "mlp.shared_experts.gate_proj.weight", *_T),
      Tensor("shared_experts/wi_1/kernel", "mlp.shared_experts.up_proj.weight", *_T),
      Tensor("shared_experts/wo/kernel", "mlp.shared_experts.down_proj.weight", *_T),
    ]
  return out


def _rope(hf: dict[str, Any], source: str) -> dict[str, Any]:
  """config.json's RoPE as transformers 5 reads it: rope_scaling (4.x's key) before rope_parameters, theta from
  either; YaRN's two factors as transformers computes them (layers/rope.py hf_yarn_attention_factor)."""
  rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
  theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind == "default":
    return {"rope_type": "default", "rope_max_timescale": theta}
  if kind != "yarn":
    raise InputError(f"{source}: rope_type={kind!r} is not supported for DeepSeek (default, yarn)")
  if rope.get("factor") is None or rope.get("original_max_position_embeddings") is None:
    raise InputError(f"{source}: rope_type=yarn needs factor and original_max_position_embeddings")
  factor = float(rope["factor"])
  mscale_all_dim = rope.get("mscale_all_dim") or 0.0
  cos_sin = hf_yarn_attention_factor(factor, rope.get("attention_factor"), rope.get("mscale"), mscale_all_dim)
  return {
    "rope_type": "yarn",
    "rope_max_timescale": theta,
    "rope_factor": factor,
    "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
    "beta_fast": float(rope.get("beta_fast") or 32),
    "beta_slow": float(rope.get("beta_slow") or 1),
    "rope_truncate": bool(rope.get("truncate", True)),
    "mscale": float(mscale_all_dim),  # the softmax's (transformers' yarn_apply_mscale)
    "rope_attention_factor": cos_sin,
  }


def _hf_yarn(config: Any) -> dict[str, Any]:
  """The YaRN keys of config.json. attention_factor is what transformers (4.x and 5) multiplies cos/sin by; vLLM
  reads only the mscale / mscale_all_dim ratio, so mscale is chosen to give the same factor there."""
  factor, all_dim, cos_sin = config.rope_factor, config.mscale, yarn_attention_factor(config)
  if factor <= 1 or cos_sin == (1.0 if all_dim else yarn_mscale(factor)):
    mscale = all_dim if all_dim else 1.0  # the factor the pair's ratio already gives
  else:  # yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim) = cos_sin
    mscale = (cos_sin * yarn_mscale(factor, all_dim) - 1.0) / (0.1 * math.log(factor))
  return {
    "rope_type": "yarn",
    "factor": factor,
    "original_max_position_embeddings": config.original_max_position_embeddings,
    "beta_fast": config.beta_fast,
    "beta_slow": config.beta_slow,
    "mscale": mscale,
    "mscale_all_dim": all_dim,
    "attention_factor": cos_sin,
    "truncate": config.rope_truncate,
  }


def settings_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
  if hf.get("hidden_act", "silu") != "silu":
    raise InputError(f"{source}: hidden_act={hf['hidden_act']!r}; MaxLite's DeepSeek MLPs are SwiGLU (silu)")
  if hf.get("attention_bias"):
    raise InputError(f"{source}: attention_bias=true is not supported for DeepseekV3ForCausalLM")
  if not hf.get("rope_interleave", True):
    raise InputError(f"{source}: rope_interleave=false is not supported (the converter permutes interleaved RoPE rows)")
  if hf.get("topk_method", "noaux_tc") != "noaux_tc":
    raise InputError(f"{source}: topk_method={hf['topk_method']!r} is not supported (DeepSeek-V3's noaux_tc)")
  groups = hf.get("n_group") or 1
  return {
    "base_emb_dim": hf["hidden_size"],
    "base_num_query_heads": hf["num_attention_heads"],
    "base_num_kv_heads": hf["num_attention_heads"],
    "head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
    "base_mlp_dim": hf["intermediate_size"],
    "base_moe_mlp_dim": hf["moe_intermediate_size"],
    "base_num_decoder_layers": hf["num_hidden_layers"],
    "first_num_dense_layers": hf.get("first_k_dense_replace", 3),
    "vocab_size": hf["vocab_size"],
    "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
    "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
    "max_position_embeddings": int(hf.get("max_position_embeddings") or -1),
    "attention_type": "mla",
    "q_lora_rank": hf.get("q_lora_rank") or 0,
    "kv_lora_rank": hf["kv_lora_rank"],
    "qk_nope_head_dim": hf["qk_nope_head_dim"],
    "qk_rope_head_dim": hf["qk_rope_head_dim"],
    "v_head_dim": hf["v_head_dim"],
    "num_experts": hf.get("n_routed_experts") or hf["num_local_experts"],
    "num_experts_per_tok": hf["num_experts_per_tok"],
    "shared_experts": hf.get("n_shared_experts") or 0,
    "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
    "routed_score_func": "sigmoid",
    "routed_bias": True,
    "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
    "n_routing_groups": groups if groups > 1 else -1,
    "topk_routing_group": (hf.get("topk_group") or 1) if groups > 1 else -1,
    "attention_bias": False,
    **_rope(hf, source),
  }


def hf_config(config: Any, bos_id: int | None = None, eos_id: int | None = None) -> dict[str, Any]:
  if config.attention_type != "mla" or config.routed_score_func != "sigmoid" or not config.routed_bias:
    raise InputError(
      "to_hf: DeepseekV3ForCausalLM needs attention_type=mla, routed_score_func=sigmoid, routed_bias=true"
    )
  if config.rope_type not in ("default", "yarn"):
    raise InputError(f"to_hf: DeepseekV3ForCausalLM takes rope_type default or yarn, not {config.rope_type}")
  scaling = _hf_yarn(config) if config.rope_type == "yarn" else None
  grouped = config.n_routing_groups > 1
  context = config.max_position_embeddings
  if context < 1:  # transformers 4.x's yarn takes max_position_embeddings / original as the factor: keep them equal
    context = int(config.original_max_position_embeddings * config.rope_factor) if scaling else config.max_target_length
  return {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_act": "silu",
    "hidden_size": config.base_emb_dim,
    "intermediate_size": config.base_mlp_dim,
    "moe_intermediate_size": config.moe_mlp_dim,
    "num_attention_heads": config.base_num_query_heads,
    "num_key_value_heads": config.base_num_query_heads,
    "num_hidden_layers": config.base_num_decoder_layers,
    "first_k_dense_replace": config.first_num_dense_layers,
    "vocab_size": config.vocab_size,
    "rms_norm_eps": config.normalization_layer_epsilon,
    "q_lora_rank": config.q_lora_rank or None,
    "kv_lora_rank": config.kv_lora_rank,
    "qk_nope_head_dim": config.qk_nope_head_dim,
    "qk_rope_head_dim": config.qk_rope_head_dim,
    "v_head_dim": config.v_head_dim,
    "n_routed_experts": config.num_experts,
    "num_experts_per_tok": config.num_experts_per_tok,
    "n_shared_experts": config.shared_experts,
    "norm_topk_prob": config.norm_topk_prob,
    "routed_scaling_factor": config.routed_scaling_factor,
    "n_group": config.n_routing_groups if grouped else 1,
    "topk_group": config.topk_routing_group if grouped else 1,
    **hf_layout.rope_keys(config.rope_max_timescale, scaling),
    "rope_interleave": True,
    "attention_bias": False,
    "tie_word_embeddings": config.logits_via_embedding,
    "max_position_embeddings": context,
    "bos_token_id": bos_id,
    "eos_token_id": eos_id,
    "torch_dtype": config.weight_dtype,
  }
