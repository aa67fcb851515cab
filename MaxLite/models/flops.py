"""Model FLOPs per training step, counted per matmul the way MaxText does.

A matmul of [m, k] x [k, n] is 2*m*k*n FLOPs; training costs 3x the forward pass (forward,
backward w.r.t. activations, backward w.r.t. weights). Causal attention only needs the lower
triangle of the score matrix, so its two matmuls are counted at half of the dense cost.
Rematerialisation is not counted: this is *model* FLOPs, the numerator of MFU. For MoE only the
num_experts_per_tok active experts (and the router) count.
"""

from __future__ import annotations

from MaxLite.config import Config
from MaxLite.config.families import family


def training_flops_per_step(config: Config) -> dict[str, float]:
  """FLOPs of one optimizer step over the whole global batch, split by where they are spent: {weights, attention,
  total, experts}, counted by the config's decoder family."""
  return family(config.decoder_block).training_flops(config)


def decoder_flops(config: Config, attended_keys: float | None = None) -> dict[str, float]:
  """A Llama-shaped decoder's training FLOPs. attended_keys: the keys a query attends to, averaged over the
  sequence and the layers (causal: max_target_length / 2)."""
  tokens = config.global_batch_size_to_train_on * config.max_target_length
  seq = config.max_target_length
  emb, mlp, d = config.base_emb_dim, config.base_mlp_dim, config.head_dim
  q, kv, layers = config.base_num_query_heads, config.base_num_kv_heads, config.base_num_decoder_layers
  mlp_flops = 2 * tokens * emb * mlp * 3  # gate, up and down projections
  expert_flops = 0
  if config.num_experts > 1:
    # Only the experts a token is routed to do work; the one-hot dispatch/combine einsums are
    # routing overhead, not model FLOPs.
    expert_flops = 2 * tokens * emb * config.moe_mlp_dim * 3 * config.num_experts_per_tok
    mlp_flops = expert_flops + 2 * tokens * emb * config.num_experts
  qkv_flops = 2 * tokens * emb * d * (q + 2 * kv)
  out_flops = 2 * tokens * q * d * emb
  # QK^T and PV: 2 matmuls of 2*keys*d FLOPs per token per head; a causal query sees half the sequence on average.
  keys = seq / 2 if attended_keys is None else attended_keys
  attention_flops = 2 * 2 * tokens * keys * q * d
  logits_flops = 2 * tokens * emb * config.vocab_size
  weights = 3 * (layers * (mlp_flops + qkv_flops + out_flops) + logits_flops)
  attention = 3 * layers * attention_flops
  return {
    "weights": float(weights),
    "attention": float(attention),
    "total": float(weights + attention),
    "experts": float(3 * layers * expert_flops),  # part of "weights": the routed tokens' expert matmuls
  }


def tflops_per_device_per_step(config: Config) -> float:
  """An ensemble's devices do every member's work."""
  return training_flops_per_step(config)["total"] * config.ensemble_size / config.num_devices / 1e12
