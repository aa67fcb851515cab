"""GPT-OSS's Hugging Face map: transformers' GptOss config.json <-> MaxLite's keys, and each layer's tensors.

transformers keeps each layer's experts as four stacked tensors: gate_up_proj [experts, embed, 2 x mlp] with the gate
and up columns interleaved (gate in the even ones), its bias [experts, 2 x mlp], down_proj [experts, mlp, embed] and
its bias; MaxLite's are wi_0 / wi_1 / wo and their biases, so one tensor holds two MaxLite weights (a Tensor with two
paths). OpenAI's published checkpoints store gate_up_proj and down_proj in MXFP4 (`<name>_blocks` and
`<name>_scales`): `read` dequantizes those (models/mxfp4.py); checkpoints in bfloat16 are read as they are. The
export writes the unquantized form, which transformers loads as it loads a bfloat16 checkpoint.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from MaxLite.cli.errors import InputError
from MaxLite.models import hf_layout, mxfp4
from MaxLite.models.hf_layout import Tensor

ALPHA = 1.702  # transformers' swiglu_alpha; MaxLite's gated unit has it fixed, as MaxText's has
_SAME = (lambda w: w, lambda k: k)
_T = (lambda w: w.T, lambda k: k.T)


def _split_gate_up(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  return w[..., 0::2], w[..., 1::2]


def _interleave(pair: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
  gate, up = pair
  return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def layer_tensors(config: Any, layer: int) -> list[Tensor]:
  del layer  # every layer has the same weights (sliding or not)
  h, kv, hd = config.base_num_query_heads, config.base_num_kv_heads, config.head_dim
  qkv, out_proj = hf_layout.attention_tensors(config)
  out = [
    *qkv,
    out_proj,
    Tensor("pre_self_attention_norm/scale", "input_layernorm.weight", *_SAME),
    Tensor("post_self_attention_norm/scale", "post_attention_layernorm.weight", *_SAME),
    Tensor("moe/gate/kernel", "mlp.router.weight", *_T),
    Tensor(("moe/wi_0", "moe/wi_1"), "mlp.experts.gate_up_proj", _split_gate_up, _interleave),
    Tensor("moe/wo", "mlp.experts.down_proj", *_SAME),
  ]
  if config.attention_bias:
    bias = lambda n: (lambda b: b.reshape(n, hd), lambda b: b.reshape(n * hd))
    out += [
      Tensor("self_attention/query/bias", "self_attn.q_proj.bias", *bias(h)),
      Tensor("self_attention/key/bias", "self_attn.k_proj.bias", *bias(kv)),
      Tensor("self_attention/value/bias", "self_attn.v_proj.bias", *bias(kv)),
      Tensor("self_attention/out/bias", "self_attn.o_proj.bias", *_SAME),
    ]
  if config.attention_sink:
    out.append(Tensor("self_attention/sinks", "self_attn.sinks", *_SAME))
  if config.routed_bias:
    out.append(Tensor("moe/gate/bias", "mlp.router.bias", *_SAME))
  if config.mlp_bias:
    out += [
      Tensor(("moe/wi_0_bias", "moe/wi_1_bias"), "mlp.experts.gate_up_proj_bias", _split_gate_up, _interleave),
      Tensor("moe/wo_bias", "mlp.experts.down_proj_bias", *_SAME),
    ]
  return out


def global_tensors(config: Any) -> list[Tensor]:
  return hf_layout.global_tensors(config.logits_via_embedding)


def _has(reader: Any, name: str) -> bool:
  try:
    reader.shape(name)
  except InputError:  # the reader's one error for a name it does not hold
    return False
  return True


def read(reader: Any, name: str) -> np.ndarray:
  """The tensor `name`; an expert projection stored in MXFP4 (name_blocks, name_scales) dequantized."""
  if not _has(reader, name) and _has(reader, name + mxfp4.BLOCKS):
    blocks, scales = reader.read(name + mxfp4.BLOCKS), reader.read(name + mxfp4.SCALES)
    try:
      return mxfp4.dequantize(blocks, scales)
    except ValueError as e:
      raise InputError(f"tensor {name!r}: {e}") from None
  return reader.read(name)


def layer_types(layers: int, sliding: bool) -> list[str]:
  """transformers' layer_types: sliding and full alternating, sliding first (or, without a window, all full)."""
  return ["sliding_attention" if sliding and i % 2 == 0 else "full_attention" for i in range(layers)]


def _rope(hf: dict[str, Any], source: str) -> dict[str, Any]:
  settings = hf_layout.rope_settings(hf, source)
  if settings["rope_type"] not in ("default", "yarn"):
    raise InputError(f"{source}: rope_type {settings['rope_type']} is not supported for GptOssForCausalLM")
  return settings


def settings_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
  quantization = (hf.get("quantization_config") or {}).get("quant_method")
  if quantization not in (None, "mxfp4"):
    raise InputError(f"{source}: quantization_config.quant_method={quantization!r} is not supported (mxfp4 is)")
  if float(hf.get("swiglu_alpha", ALPHA)) != ALPHA:
    raise InputError(f"{source}: swiglu_alpha={hf['swiglu_alpha']} is not supported (MaxLite's is {ALPHA})")
  limit = hf.get("swiglu_limit", 7.0)
  layers, window = hf["num_hidden_layers"], hf.get("sliding_window", 128)
  kinds = hf.get("layer_types") or layer_types(layers, True)
  if kinds == layer_types(layers, False):  # no layer slides
    window = None
  elif kinds != layer_types(layers, True):
    raise InputError(
      f"{source}: layer_types must alternate sliding_attention and full_attention, sliding first (or be all "
      "full_attention)"
    )
  heads = hf["num_attention_heads"]
  return {
    "base_emb_dim": hf["hidden_size"],
    "base_num_query_heads": heads,
    "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
    "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
    "base_mlp_dim": hf["intermediate_size"],
    "base_moe_mlp_dim": hf["intermediate_size"],
    "base_num_decoder_layers": layers,
    "vocab_size": hf["vocab_size"],
    "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-5)),
    "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
    "max_position_embeddings": int(hf.get("max_position_embeddings") or -1),
    "sliding_window_size": int(window or 0),
    "attention_bias": bool(hf.get("attention_bias", True)),
    "attention_sink": True,
    "mlp_activations": ["sigmoid", "linear"],
    "mlp_activations_limit": float(limit) if limit is not None else -1.0,
    "mlp_bias": True,
    "num_experts": hf.get("num_local_experts") or hf["num_experts"],
    "num_experts_per_tok": hf.get("num_experts_per_tok") or hf["experts_per_token"],
    "norm_topk_prob": True,
    "routed_score_func": "",
    "routed_bias": True,
    "use_qk_norm": False,
    **_rope(hf, source),
  }


def hf_config(config: Any, bos_id: int | None = None, eos_id: int | None = None) -> dict[str, Any]:
  limit = config.mlp_activations_limit
  if not (config.attention_sink and config.routed_bias and config.mlp_bias and limit > 0) or config.use_qk_norm:
    raise InputError(
      "to_hf: GptOssForCausalLM has attention sinks, a router bias, expert biases, a clamp and no q/k norms: this "
      "model needs attention_sink=true routed_bias=true mlp_bias=true mlp_activations_limit > 0 use_qk_norm=false"
    )
  if config.rope_type not in ("default", "yarn"):
    raise InputError(f"to_hf: GptOssForCausalLM takes rope_type default or yarn, not {config.rope_type}")
  layers = config.base_num_decoder_layers
  scaling = hf_layout.rope_scaling(config)
  context = config.max_position_embeddings
  if context < 1:
    context = int(config.original_max_position_embeddings * config.rope_factor) if scaling else config.max_target_length
  return {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_act": "silu",
    "hidden_size": config.base_emb_dim,
    "intermediate_size": config.moe_mlp_dim,
    "num_attention_heads": config.base_num_query_heads,
    "num_key_value_heads": config.base_num_kv_heads,
    "head_dim": config.head_dim,
    "num_hidden_layers": layers,
    "vocab_size": config.vocab_size,
    "rms_norm_eps": config.normalization_layer_epsilon,
    "layer_types": layer_types(layers, config.sliding_window_size > 0),
    "attention_bias": config.attention_bias,
    "num_local_experts": config.num_experts,
    "num_experts_per_tok": config.num_experts_per_tok,
    "swiglu_alpha": ALPHA,
    "swiglu_limit": limit,
    **hf_layout.rope_keys(config.rope_max_timescale, scaling),
    "tie_word_embeddings": config.logits_via_embedding,
    "max_position_embeddings": context,
    "bos_token_id": bos_id,
    "eos_token_id": eos_id,
    "torch_dtype": config.weight_dtype,
    # transformers builds a sliding mask even where no layer slides, so a model without a window keeps its default
    **({"sliding_window": config.sliding_window_size} if config.sliding_window_size > 0 else {}),
  }
