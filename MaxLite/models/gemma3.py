"""Gemma 3 (text): MaxText's `gemma3` block. Five local layers (sliding-window attention, RoPE base
local_rope_max_timescale) for every global one (full attention, rope_max_timescale with rope_linear_scaling_factor);
q/k RMSNorm; RMSNorm before and after both attention and the GeGLU MLP; embeddings scaled by sqrt(width); the output
head tied to the embedding. Norm weights are stored as transformers stores them (w, applied as 1 + w).

Under nn.scan the layers share one traced body, so a layer's kind is decided from its depth at run time: the
dot-product path masks with a traced condition, the splash kernel runs the local or the global kernel by lax.cond.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxLite.cli.errors import ConfigError, InputError
from MaxLite.config import Config, families
from MaxLite.layers.attention import Attention
from MaxLite.layers.mlp import MlpBlock
from MaxLite.layers.norms import RMSNorm
from MaxLite.layers.quantities import dtype_of
from MaxLite.layers.rope import default_frequencies, rope_frequencies
from MaxLite.models import flops, hf_layout
from MaxLite.models.hf_layout import Tensor
from MaxLite.models.llama import attention_parameters, refuse_shared_experts
from MaxLite.parallel.sharding import EMBED_ACTIVATION

GLOBAL_EVERY = 6  # layers 5, 11, 17, ... attend globally (transformers' sliding_window_pattern, MaxText's pattern)


def is_local(layer_index: Any) -> Any:
  return (layer_index + 1) % GLOBAL_EVERY != 0


def layer_rope(cfg: Config, local: Any) -> tuple[jax.Array, Any]:
  """(frequencies, scale) of a layer: a local one turns by local_rope_max_timescale, unscaled; a global one by the
  config's RoPE (rope_max_timescale with its scaling). `local` may be traced (one scanned layer for both kinds)."""
  frequencies, scale = rope_frequencies(cfg)
  theta = cfg.local_rope_max_timescale if cfg.local_rope_max_timescale > 0 else cfg.rope_max_timescale
  frequencies = jnp.where(local, default_frequencies(cfg.head_dim, theta), frequencies)
  return frequencies, (jnp.where(local, 1.0, scale) if scale != 1.0 else scale)


class Gemma3Layer(nn.Module):
  config: Config
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, layer_index: Any) -> tuple:
    cfg = self.config
    norm = dict(
      epsilon=cfg.normalization_layer_epsilon,
      dtype=dtype_of(cfg.dtype),
      weight_dtype=dtype_of(cfg.weight_dtype),
      scale_offset=1.0,
    )
    dropout = lambda h: nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(h, deterministic=self.deterministic)
    x = checkpoint_name(nn.with_logical_constraint(x, EMBED_ACTIVATION), "decoder_layer_input")
    h = RMSNorm(name="pre_self_attention_norm", **norm)(x)
    local = is_local(layer_index)
    h = Attention(cfg, self.decode, qk_norm_offset=1.0, name="self_attention")(
      h, positions, segment_ids, sliding=local, rope=layer_rope(cfg, local)
    )
    if cfg.use_post_attn_norm:
      h = RMSNorm(name="post_self_attention_norm", **norm)(h)
    x = x + dropout(h)
    h = MlpBlock(cfg, name="mlp")(RMSNorm(name="pre_ffw_norm", **norm)(x))
    if cfg.use_post_ffw_norm:
      h = RMSNorm(name="post_ffw_norm", **norm)(h)
    x = x + dropout(h)
    return nn.with_logical_constraint(x, EMBED_ACTIVATION), None


def parameter_count(c: Mapping[str, Any]) -> int:
  emb, vocab = c["base_emb_dim"], c["vocab_size"]
  norms = 2 + c["use_post_attn_norm"] + c["use_post_ffw_norm"]
  per_layer = attention_parameters(c) + 3 * emb * c["base_mlp_dim"] + norms * emb
  head = 0 if c["logits_via_embedding"] else emb * vocab
  return vocab * emb + c["base_num_decoder_layers"] * per_layer + emb + head


def training_flops(config: Config) -> dict[str, float]:
  """A global layer's query sees half the sequence on average; a local one at most sliding_window_size keys."""
  seq, window, layers = config.max_target_length, config.sliding_window_size, config.base_num_decoder_layers
  local_layers = sum(bool(is_local(i)) for i in range(layers))
  local_keys = seq / 2 if window >= seq else window - window * window / (2 * seq)
  attended = (local_layers * local_keys + (layers - local_layers) * seq / 2) / layers
  return flops.decoder_flops(config, attended_keys=attended)


def check(c: Mapping[str, Any]) -> None:
  refuse_shared_experts(c)
  if list(c["mlp_activations"]) != ["gelu", "linear"]:
    raise ConfigError(f"decoder_block=gemma3 needs mlp_activations=['gelu', 'linear'], got {c['mlp_activations']}")
  if c["num_experts"] > 1:
    raise ConfigError(
      f"decoder_block=gemma3 has a dense MLP; num_experts={c['num_experts']} needs decoder_block=llama2"
    )
  if c["sliding_window_size"] < 1:
    raise ConfigError(
      f"decoder_block=gemma3 needs sliding_window_size >= 1 (its local layers' window), got {c['sliding_window_size']}"
    )
  if c["attention_bias"]:
    raise ConfigError("decoder_block=gemma3 has no attention biases; set attention_bias=false")


# ---------------------------------------------------------------- Hugging Face (Gemma3ForCausalLM, text only)

_SAME = (lambda w: w, lambda k: k)
_T = (lambda w: w.T, lambda k: k.T)


def layer_tensors(config: Any, layer: int) -> list[Tensor]:
  del layer  # every layer has the same weights
  qkv, out_proj = hf_layout.attention_tensors(config)
  out = [
    *qkv,
    out_proj,
    Tensor("self_attention/query_norm/scale", "self_attn.q_norm.weight", *_SAME),
    Tensor("self_attention/key_norm/scale", "self_attn.k_norm.weight", *_SAME),
    Tensor("pre_self_attention_norm/scale", "input_layernorm.weight", *_SAME),
    Tensor("pre_ffw_norm/scale", "pre_feedforward_layernorm.weight", *_SAME),
    Tensor("mlp/wi_0/kernel", "mlp.gate_proj.weight", *_T),
    Tensor("mlp/wi_1/kernel", "mlp.up_proj.weight", *_T),
    Tensor("mlp/wo/kernel", "mlp.down_proj.weight", *_T),
  ]
  if config.use_post_attn_norm:
    out.append(Tensor("post_self_attention_norm/scale", "post_attention_layernorm.weight", *_SAME))
  if config.use_post_ffw_norm:
    out.append(Tensor("post_ffw_norm/scale", "post_feedforward_layernorm.weight", *_SAME))
  return out


def _rope(hf: dict[str, Any], source: str) -> dict[str, Any]:
  """Both layer kinds' RoPE from transformers 5's rope_parameters (per layer kind) or 4's rope_theta /
  rope_local_base_freq / rope_scaling."""
  params = hf.get("rope_parameters") or {}
  full = dict(params.get("full_attention") or {})
  local = dict(params.get("sliding_attention") or {})
  full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
  local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
  scaling = hf.get("rope_scaling") or {}
  full = {**scaling, **full} if scaling and "factor" not in full else full
  for kind, rope in (("full_attention", full), ("sliding_attention", local)):
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear") or (kind == "sliding_attention" and rope_type != "default"):
      raise InputError(f"{source}: {kind} rope_type={rope_type!r} is not supported (Gemma 3 uses default, linear)")
  return {
    "rope_max_timescale": float(full["rope_theta"]),
    "rope_linear_scaling_factor": float(full.get("factor", 1.0)) if full.get("rope_type") == "linear" else 1.0,
    "local_rope_max_timescale": float(local["rope_theta"]),
    "rope_type": "default",
  }


def settings_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
  if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu"):
    raise InputError(f"{source}: hidden_activation={hf['hidden_activation']!r}; MaxLite's Gemma MLP is GeGLU (tanh)")
  if hf.get("attention_bias"):
    raise InputError(f"{source}: attention_bias=true is not supported for Gemma3ForCausalLM")
  layers, pattern = hf["num_hidden_layers"], hf.get("sliding_window_pattern", GLOBAL_EVERY)
  expected = ["sliding_attention" if is_local(i) else "full_attention" for i in range(layers)]
  if (hf.get("layer_types") or expected) != expected or pattern != GLOBAL_EVERY:
    raise InputError(f"{source}: layer_types must be five sliding_attention layers to each full_attention one")
  if hf.get("use_bidirectional_attention"):
    raise InputError(f"{source}: use_bidirectional_attention=true is not supported (MaxLite trains causal decoders)")
  heads, head_dim = hf["num_attention_heads"], hf.get("head_dim", 256)
  scalar = hf.get("query_pre_attn_scalar", 256)
  return {
    "base_emb_dim": hf["hidden_size"],
    "base_num_query_heads": heads,
    "base_num_kv_heads": hf.get("num_key_value_heads", heads),
    "head_dim": head_dim,
    "base_mlp_dim": hf["intermediate_size"],
    "base_num_decoder_layers": layers,
    "vocab_size": hf["vocab_size"],
    "mlp_activations": ["gelu", "linear"],
    "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
    "logits_via_embedding": bool(hf.get("tie_word_embeddings", True)),
    "max_position_embeddings": int(hf.get("max_position_embeddings") or -1),
    "sliding_window_size": int(hf.get("sliding_window", 4096)),
    "query_pre_attn_scalar": 0 if scalar == head_dim else scalar,
    "use_qk_norm": True,
    "use_post_attn_norm": True,
    "use_post_ffw_norm": True,
    "attn_logits_soft_cap": float(hf.get("attn_logit_softcapping") or 0.0),
    "final_logits_soft_cap": float(hf.get("final_logit_softcapping") or 0.0),
    "attention_bias": False,
    "num_experts": 1,
    **_rope(hf, source),
  }


def hf_config(config: Any, bos_id: int | None = None, eos_id: int | None = None) -> dict[str, Any]:
  if not (config.use_post_attn_norm and config.use_post_ffw_norm and config.use_qk_norm):
    raise InputError(
      "to_hf: Gemma3ForCausalLM has q/k norms and post-attention and post-MLP norms; this model lacks some"
    )
  scaling = None
  if config.rope_linear_scaling_factor != 1.0:
    scaling = {"rope_type": "linear", "factor": config.rope_linear_scaling_factor}
  local_theta = config.local_rope_max_timescale if config.local_rope_max_timescale > 0 else config.rope_max_timescale
  layers = config.base_num_decoder_layers
  return {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": config.base_emb_dim,
    "intermediate_size": config.base_mlp_dim,
    "num_attention_heads": config.base_num_query_heads,
    "num_key_value_heads": config.base_num_kv_heads,
    "head_dim": config.head_dim,
    "query_pre_attn_scalar": config.query_pre_attn_scalar or config.head_dim,
    "num_hidden_layers": layers,
    "vocab_size": config.vocab_size,
    "rms_norm_eps": config.normalization_layer_epsilon,
    "sliding_window": config.sliding_window_size,
    "layer_types": ["sliding_attention" if is_local(i) else "full_attention" for i in range(layers)],
    # Both forms (hf_layout.rope_keys): transformers 4.x and vLLM read rope_theta, rope_scaling (the global layers')
    # and rope_local_base_freq, and would drop the global layers' linear scaling found in rope_parameters alone.
    "rope_theta": config.rope_max_timescale,
    "rope_scaling": scaling,
    "rope_local_base_freq": local_theta,
    "rope_parameters": {
      "full_attention": hf_layout.rope_keys(config.rope_max_timescale, scaling)["rope_parameters"],
      "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
    },
    "attn_logit_softcapping": config.attn_logits_soft_cap or None,
    "final_logit_softcapping": config.final_logits_soft_cap or None,
    "attention_bias": False,
    "tie_word_embeddings": config.logits_via_embedding,
    "max_position_embeddings": config.max_position_embeddings
    if config.max_position_embeddings > 0
    else config.max_target_length,
    "bos_token_id": bos_id,
    "eos_token_id": eos_id,
    "torch_dtype": config.weight_dtype,
  }


families.register(
  families.Family(
    decoder_blocks=("gemma3",),
    layer=Gemma3Layer,
    parameter_count=parameter_count,
    training_flops=training_flops,
    hf=families.HfLayout(
      architectures=("Gemma3ForCausalLM",),
      settings=settings_from_hf,
      config=hf_config,
      layer_tensors=layer_tensors,
      global_tensors=lambda config: hf_layout.global_tensors(config.logits_via_embedding),
    ),
    check=check,
    scale_embeddings=True,
    norm_scale_offset=1.0,
  )
)
