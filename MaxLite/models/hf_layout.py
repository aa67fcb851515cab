"""How Hugging Face checkpoints map onto MaxLite's model: config.json <-> model keys, tensor names <-> param paths.

Pure data and reshapes, no I/O (hf.py streams the tensors). Supported: LlamaForCausalLM (rope_scaling llama3 and
yarn included), MistralForCausalLM, Qwen2ForCausalLM (q/k/v biases), Qwen3ForCausalLM (q/k RMSNorm),
Qwen3MoeForCausalLM and MixtralForCausalLM (a sparse MoE block in every layer). Anything else a config.json asks for
is refused by name.

MaxLite's RoPE rotates the two halves of each head (the Hugging Face layout) and scales q by head_dim**-0.5
inside attention, as transformers does, so q/k weights need no permutation: transposes and reshapes only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from MaxLite.cli.errors import InputError
from MaxLite.layers.rope import hf_yarn_attention_factor

ARCHITECTURES = (
  "LlamaForCausalLM",
  "MistralForCausalLM",
  "Qwen2ForCausalLM",
  "Qwen3ForCausalLM",
  "Qwen3MoeForCausalLM",
  "MixtralForCausalLM",
)
_MODEL_TYPE = {
  "LlamaForCausalLM": "llama",
  "Qwen2ForCausalLM": "qwen2",
  "Qwen3ForCausalLM": "qwen3",
  "Qwen3MoeForCausalLM": "qwen3_moe",
  "MixtralForCausalLM": "mixtral",
}


class Tensor(NamedTuple):
  """One weight: MaxLite path (inside a layer for layer tensors), HF name ("{e}" = one tensor per expert,
  stacked on MaxLite's leading expert axis) and the two conversions of one (per-expert) array.

  part = (axis, index, count): the HF tensor is one of `count` slices of a fused MaxLite weight (fused_qkv,
  fused_mlp), stacked along `axis` of the per-layer array."""

  path: str
  hf_name: str
  to_maxlite: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]
  part: tuple[int, int, int] | None = None


def part_slice(part: tuple[int, int, int]) -> tuple:
  """The index of one part in its fused per-layer array."""
  axis, index, _ = part
  return (slice(None),) * axis + (index,)


def _fused(tensors: list[Tensor], path: str, axis: int) -> list[Tensor]:
  """The same HF tensors as slices of one MaxLite weight at `path`."""
  return [t._replace(path=path, part=(axis, i, len(tensors))) for i, t in enumerate(tensors)]


# transformers' defaults where config.json leaves a field out (each config class's own, not Llama's).
_DEFAULT_KV_HEADS = {
  "MistralForCausalLM": 8,
  "MixtralForCausalLM": 8,
  "Qwen2ForCausalLM": 32,
  "Qwen3ForCausalLM": 32,
  "Qwen3MoeForCausalLM": 4,
}
_DEFAULT_WINDOW = {"MistralForCausalLM": 4096, "MixtralForCausalLM": None}  # the others only with use_sliding_window
_DEFAULT_HEAD_DIM = {"Qwen3ForCausalLM": 128}

_SAME = (lambda w: w, lambda k: k)
_TRANSPOSED = (np.transpose, np.transpose)


def rope_settings(hf: dict[str, Any], source: str) -> dict[str, Any]:
  rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  kind = rope.get("rope_type", rope.get("type", "default"))
  theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
  if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
    raise InputError(f"{source}: partial_rotary_factor is not supported (MaxLite rotates the whole head)")
  if kind == "default":
    return {"rope_max_timescale": theta, "rope_type": "default"}
  # transformers prefers a top-level original_max_position_embeddings to the one in rope_scaling
  original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
  original = original or hf.get("max_position_embeddings")
  if rope.get("factor") is None:
    raise InputError(f"{source}: rope_scaling.factor is missing (rope_type {kind!r} needs it)")
  if kind == "llama3":
    return {
      "rope_max_timescale": theta,
      "rope_type": "llama3.1",
      "rope_factor": float(rope["factor"]),
      "rope_low_freq_factor": float(rope["low_freq_factor"]),
      "rope_high_freq_factor": float(rope["high_freq_factor"]),
      "original_max_position_embeddings": int(original),
    }
  if kind == "yarn":
    settings = {
      "rope_max_timescale": theta,
      "rope_type": "yarn",
      "rope_factor": float(rope["factor"]),
      "original_max_position_embeddings": int(original),
      "beta_fast": float(rope.get("beta_fast") or 32),
      "beta_slow": float(rope.get("beta_slow") or 1),
      "rope_truncate": bool(rope.get("truncate", True)),
    }
    scales = [rope.get(field) for field in ("attention_factor", "mscale", "mscale_all_dim")]
    if any(v is not None for v in scales):  # only cos/sin: no Llama-shaped model scales its softmax by mscale_all_dim
      settings["rope_attention_factor"] = hf_yarn_attention_factor(float(rope["factor"]), *scales)
    return settings
  raise InputError(f"{source}: rope_scaling.rope_type={kind!r} is not supported (supported: default, llama3, yarn)")


def model_settings_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
  """config.json -> MaxLite model keys; anything MaxLite does not model is refused by name."""
  arch = (hf.get("architectures") or ["?"])[0]
  if arch not in ARCHITECTURES:
    raise InputError(f"{source}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
  if hf.get("hidden_act", "silu") != "silu":
    raise InputError(f"{source}: hidden_act={hf['hidden_act']!r}; MaxLite's MLP is SwiGLU (silu)")
  if hf.get("mlp_bias"):
    raise InputError(f"{source}: mlp_bias=true is not supported (MaxLite's MLP has no bias)")
  qwen2 = arch == "Qwen2ForCausalLM"
  if hf.get("attention_bias") and not qwen2:  # there it would bias o_proj too
    raise InputError(f"{source}: attention_bias=true is not supported for {arch} (its o_proj would have a bias)")
  if hf.get("use_sliding_window"):
    raise InputError(f"{source}: use_sliding_window=true is not supported (MaxLite attends over the whole sequence)")
  window = hf.get("sliding_window", _DEFAULT_WINDOW[arch]) if arch in _DEFAULT_WINDOW else None
  if window is not None:
    raise InputError(
      f"{source}: sliding_window={window} is not supported (MaxLite attends over the whole sequence); the model is "
      f'the same for sequences of at most {window} tokens: set "sliding_window": null in config.json to convert'
    )
  heads = hf["num_attention_heads"]
  settings = {
    "base_emb_dim": hf["hidden_size"],
    "base_num_query_heads": heads,
    "base_num_kv_heads": hf.get("num_key_value_heads") or _DEFAULT_KV_HEADS.get(arch, heads),
    "head_dim": hf.get("head_dim") or _DEFAULT_HEAD_DIM.get(arch, hf["hidden_size"] // heads),
    "base_mlp_dim": hf["intermediate_size"],
    "base_num_decoder_layers": hf["num_hidden_layers"],
    "vocab_size": hf["vocab_size"],
    "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
    "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
    "max_position_embeddings": int(hf.get("max_position_embeddings") or -1),
    "attention_bias": qwen2,
    "use_qk_norm": arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
    "num_experts": 1,
    **rope_settings(hf, source),
  }
  if arch == "MixtralForCausalLM":
    # Softmax over all experts, then the chosen k renormalised (norm_topk_prob); each expert is intermediate_size
    # wide (base_moe_mlp_dim -1 = base_mlp_dim). router_aux_loss_coef is left out: it weights a training loss
    # normalised differently from MaxLite's load_balance_loss_weight, a training setting rather than the model's.
    settings.update(
      num_experts=hf.get("num_local_experts", 8),
      num_experts_per_tok=hf.get("num_experts_per_tok", 2),
      base_moe_mlp_dim=-1,
      norm_topk_prob=True,
    )
  if arch == "Qwen3MoeForCausalLM":
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
      raise InputError(
        f"{source}: decoder_sparse_step/mlp_only_layers mix dense and MoE layers; MaxLite needs MoE in every layer"
      )
    settings.update(
      num_experts=hf.get("num_experts") or hf["num_local_experts"],
      num_experts_per_tok=hf["num_experts_per_tok"],
      base_moe_mlp_dim=hf["moe_intermediate_size"],
      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )
  if arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM") and settings["num_experts"] < 2:
    # MaxLite's num_experts=1 is the dense MLP: it has no router for this checkpoint's gate
    raise InputError(f"{source}: {settings['num_experts']} expert(s); a MoE model needs at least 2")
  return settings


def architecture_of(config: Any) -> str:
  """The transformers class that computes what this MaxLite model computes."""
  if config.num_experts > 1:
    if config.attention_bias:
      raise InputError(
        "to_hf: a MoE model exports as Qwen3MoeForCausalLM or MixtralForCausalLM, which need attention_bias=false"
      )
    if config.use_qk_norm:
      return "Qwen3MoeForCausalLM"
    if not config.norm_topk_prob:  # Mixtral always renormalises; Qwen3-MoE's switch comes with q/k norm
      raise InputError(
        "to_hf: a MoE model without use_qk_norm exports as MixtralForCausalLM, which needs norm_topk_prob=true"
      )
    return "MixtralForCausalLM"
  if config.use_qk_norm and config.attention_bias:
    raise InputError("to_hf: no transformers architecture has both use_qk_norm and q/k/v-only attention_bias")
  if config.use_qk_norm:
    return "Qwen3ForCausalLM"
  return "Qwen2ForCausalLM" if config.attention_bias else "LlamaForCausalLM"


def rope_scaling(config: Any) -> dict[str, Any] | None:
  if config.rope_type == "llama3.1":
    return {
      "rope_type": "llama3",
      "factor": config.rope_factor,
      "low_freq_factor": config.rope_low_freq_factor,
      "high_freq_factor": config.rope_high_freq_factor,
      "original_max_position_embeddings": config.original_max_position_embeddings,
    }
  if config.rope_type == "yarn":
    explicit = {} if config.rope_attention_factor == -1 else {"attention_factor": config.rope_attention_factor}
    return {
      "rope_type": "yarn",
      "factor": config.rope_factor,
      "original_max_position_embeddings": config.original_max_position_embeddings,
      "beta_fast": config.beta_fast,
      "beta_slow": config.beta_slow,
      "truncate": config.rope_truncate,
      **explicit,
    }
  return None


def rope_keys(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
  """config.json's RoPE in both forms: transformers 5 reads rope_parameters; transformers 4.x and vLLM read only
  rope_theta and rope_scaling (null = unscaled) and would silently drop a scaling found in rope_parameters alone."""
  kind = (scaling or {}).get("rope_type", "default")
  return {
    "rope_theta": theta,
    "rope_scaling": scaling,
    "rope_parameters": {"rope_type": kind, "rope_theta": theta, **(scaling or {})},
  }


def hf_config_from_model(config: Any, bos_id: int | None = None, eos_id: int | None = None) -> dict[str, Any]:
  arch = architecture_of(config)
  scaling = rope_scaling(config)
  context = config.max_position_embeddings
  if context < 1:
    context = int(config.original_max_position_embeddings * config.rope_factor) if scaling else config.max_target_length
  out = {
    "architectures": [arch],
    "model_type": _MODEL_TYPE[arch],
    "hidden_act": "silu",
    "hidden_size": config.base_emb_dim,
    "intermediate_size": config.base_mlp_dim,
    "num_attention_heads": config.base_num_query_heads,
    "num_key_value_heads": config.base_num_kv_heads,
    "head_dim": config.head_dim,
    "num_hidden_layers": config.base_num_decoder_layers,
    "vocab_size": config.vocab_size,
    "rms_norm_eps": config.normalization_layer_epsilon,
    **rope_keys(config.rope_max_timescale, scaling),
    "tie_word_embeddings": config.logits_via_embedding,
    "max_position_embeddings": context,
    "bos_token_id": bos_id,
    "eos_token_id": eos_id,
    "torch_dtype": config.weight_dtype,
  }
  if arch == "LlamaForCausalLM":
    out.update(attention_bias=False, mlp_bias=False)
  elif arch == "MixtralForCausalLM":  # no bias switches; its experts are intermediate_size wide
    out.update(
      intermediate_size=config.moe_mlp_dim,
      sliding_window=None,
      num_local_experts=config.num_experts,
      num_experts_per_tok=config.num_experts_per_tok,
    )
  else:
    out.update(use_sliding_window=False, **({} if arch == "Qwen2ForCausalLM" else {"attention_bias": False}))
  if arch == "Qwen3MoeForCausalLM":
    out.update(
      num_experts=config.num_experts,
      num_experts_per_tok=config.num_experts_per_tok,
      moe_intermediate_size=config.moe_mlp_dim,
      norm_topk_prob=config.norm_topk_prob,
      decoder_sparse_step=1,
      mlp_only_layers=[],
    )
  return out


def attention_tensors(config: Any) -> tuple[list[Tensor], Tensor]:
  """([q, k, v projections], output projection) of transformers' self_attn, unfused and without biases."""
  e, h, kv, hd = config.base_emb_dim, config.base_num_query_heads, config.base_num_kv_heads, config.head_dim
  project = lambda n: (lambda w: w.T.reshape(e, n, hd), lambda k: k.reshape(e, n * hd).T)
  qkv = [
    Tensor("self_attention/query/kernel", "self_attn.q_proj.weight", *project(h)),
    Tensor("self_attention/key/kernel", "self_attn.k_proj.weight", *project(kv)),
    Tensor("self_attention/value/kernel", "self_attn.v_proj.weight", *project(kv)),
  ]
  out = Tensor(
    "self_attention/out/kernel",
    "self_attn.o_proj.weight",
    lambda w: w.T.reshape(h, hd, e),
    lambda k: k.reshape(h * hd, e).T,
  )
  return qkv, out


def layer_tensors(config: Any) -> list[Tensor]:
  """The weights of one decoder layer."""
  h, kv, hd = config.base_num_query_heads, config.base_num_kv_heads, config.head_dim
  bias = lambda n: (lambda b: b.reshape(n, hd), lambda b: b.reshape(n * hd))
  qkv, out_proj = attention_tensors(config)
  qkv_bias = [
    Tensor("self_attention/query/bias", "self_attn.q_proj.bias", *bias(h)),
    Tensor("self_attention/key/bias", "self_attn.k_proj.bias", *bias(kv)),
    Tensor("self_attention/value/bias", "self_attn.v_proj.bias", *bias(kv)),
  ]
  if config.fused_qkv:  # [embed, 3, heads, head_dim] and its [3, heads, head_dim] bias
    qkv = _fused(qkv, "self_attention/qkv_proj/kernel", 1)
    qkv_bias = _fused(qkv_bias, "self_attention/qkv_proj/bias", 0)
  out = [
    *qkv,
    out_proj,
    Tensor("pre_self_attention_norm/scale", "input_layernorm.weight", *_SAME),
    Tensor("post_self_attention_norm/scale", "post_attention_layernorm.weight", *_SAME),
  ]
  if config.attention_bias:
    out += qkv_bias
  if config.use_qk_norm:
    out += [
      Tensor("self_attention/query_norm/scale", "self_attn.q_norm.weight", *_SAME),
      Tensor("self_attention/key_norm/scale", "self_attn.k_norm.weight", *_SAME),
    ]
  if config.num_experts > 1 and architecture_of(config) == "MixtralForCausalLM":
    # The names transformers (5.x too, whose modules fuse the experts) saves and the Hub's Mixtral checkpoints use.
    out += [
      Tensor("moe/gate/kernel", "block_sparse_moe.gate.weight", *_TRANSPOSED),
      Tensor("moe/wi_0", "block_sparse_moe.experts.{e}.w1.weight", *_TRANSPOSED),
      Tensor("moe/wi_1", "block_sparse_moe.experts.{e}.w3.weight", *_TRANSPOSED),
      Tensor("moe/wo", "block_sparse_moe.experts.{e}.w2.weight", *_TRANSPOSED),
    ]
  elif config.num_experts > 1:
    out += [
      Tensor("moe/gate/kernel", "mlp.gate.weight", *_TRANSPOSED),
      Tensor("moe/wi_0", "mlp.experts.{e}.gate_proj.weight", *_TRANSPOSED),
      Tensor("moe/wi_1", "mlp.experts.{e}.up_proj.weight", *_TRANSPOSED),
      Tensor("moe/wo", "mlp.experts.{e}.down_proj.weight", *_TRANSPOSED),
    ]
  else:
    gate_up = [
      Tensor("mlp/wi_0/kernel", "mlp.gate_proj.weight", *_TRANSPOSED),
      Tensor("mlp/wi_1/kernel", "mlp.up_proj.weight", *_TRANSPOSED),
    ]
    if config.fused_mlp:  # [embed, 2, mlp]
      gate_up = _fused(gate_up, "mlp/wi/kernel", 1)
    out += [*gate_up, Tensor("mlp/wo/kernel", "mlp.down_proj.weight", *_TRANSPOSED)]
  return out


def global_tensors(tied: bool) -> list[Tensor]:
  out = [
    Tensor("token_embedder/embedding", "model.embed_tokens.weight", *_SAME),
    Tensor("decoder_norm/scale", "model.norm.weight", *_SAME),
  ]
  if not tied:
    out.append(Tensor("logits_dense/kernel", "lm_head.weight", *_TRANSPOSED))
  return out


def layer_slot(family: Any, config: Any, layer: int) -> tuple[Any, int]:
  """The stack (decoder/<name>, a models.Stack) that holds Hugging Face layer `layer` of `family`, and the layer's
  index in it."""
  for stack in family.stacks(config):
    if layer < stack.count:
      return stack, layer
    layer -= stack.count
  raise IndexError(layer)
