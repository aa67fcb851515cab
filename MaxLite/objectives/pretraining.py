"""Pretraining, the objective when no post-training flag is set: next-token cross-entropy (plus z-loss and the MoE
load-balancing loss) summed over real tokens, from whole logits, token tiles or vocabulary slices (cross_entropy.py).

It reads plain text: one column of each record (train_data_columns' only entry, else grain_text_column), so the chat
template and SFT's completion-only mask are refused here by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from MaxLite.cli.errors import ConfigError
from MaxLite.config import objectives
from MaxLite.runtime.lazy import jax, jnp


def derive(c: dict[str, Any]) -> dict[str, Any]:
  for key in ("train_data_columns", "eval_data_columns"):
    if len(c[key]) > 1:
      raise ConfigError(f"{key}={list(c[key])}: pretraining reads one text column; set use_sft or use_dpo")
  for key in ("use_chat_template", "sft_train_on_completion_only"):
    if c[key]:
      raise ConfigError(f"{key}=true needs use_sft=true or use_dpo=true (pretraining reads plain text)")
  return {}  # the text column is train_data_columns[0], else grain_text_column


def token_sums(out: Any, extra: dict[str, Any], batch: dict[str, jax.Array], mask: jax.Array, config: Any) -> dict:
  """Cross-entropy, z-loss and MoE sums over the tokens where mask is 1, from the model's output (`out`: logits, or
  (hidden, head) when the loss tiles or slices them) and intermediates."""
  from MaxLite.models.transformer import logits_dtype
  from MaxLite.objectives import cross_entropy

  tiled, sliced = config.num_vocab_tiling > 1, config.vocab_slices > 1
  if tiled or sliced:
    hidden, head = out
    split_loss = cross_entropy.tiled_loss_sums if tiled else cross_entropy.vocab_sliced_loss_sums
    n = config.num_vocab_tiling if tiled else config.vocab_slices
    xent_sum, z_sum = split_loss(
      hidden, head, batch["targets"], mask, config.z_loss_multiplier, n, logits_dtype(config)
    )
  else:
    xent_sum, z_sum = cross_entropy.loss_sums(out, batch["targets"], mask, config.z_loss_multiplier)
  tokens = jnp.sum(mask)
  sums = {"xent_sum": xent_sum, "z_sum": z_sum, "tokens": tokens, "count": tokens}
  if "moe" in extra.get("intermediates", {}):
    moe = extra["intermediates"]["moe"][0]
    # Token-weighted like the other terms, so gradient accumulation and sharding leave it unchanged.
    sums.update(moe_lb_sum=moe["lb_loss"] * tokens, moe_dropped=moe["dropped"], moe_routed=moe["routed"])
    if "expert_counts" in moe:  # [MoE layers, experts], for the routing-bias update
      sums["expert_counts"] = moe["expert_counts"]
  sums["loss_sum"] = sums["xent_sum"] + sums["z_sum"] + config.load_balance_loss_weight * sums.get("moe_lb_sum", 0.0)
  return sums


def loss_sums(params: Any, reference: Any, apply_fn: Any, batch: dict[str, jax.Array], rng: jax.Array, config: Any):
  """(total, sums) over the batch's learned tokens (targets_segmentation != 0)."""
  del reference
  from MaxLite.objectives import cross_entropy

  split = config.num_vocab_tiling > 1 or config.vocab_slices > 1
  out, extra = cross_entropy.forward(params, apply_fn, batch, rng, return_hidden=split)
  mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  sums = token_sums(out, extra, batch, mask, config)
  return sums["loss_sum"], sums


def train_metrics(sums: dict[str, Any], count: Any) -> dict[str, Any]:
  return {"z_loss": sums["z_sum"] / count}


def eval_metrics(totals: dict[str, Any], config: Any) -> dict[str, float]:
  del config
  """Cross-entropy per token, without z-loss."""
  return {"eval_loss": totals["xent_sum"] / max(totals["tokens"], 1.0)}


def selects(c: Mapping[str, Any]) -> bool:
  del c
  return False  # chosen when no other objective is


OBJECTIVE = objectives.register(
  objectives.Objective(
    name="pretraining",
    flag="",
    selects=selects,
    loss_sums=loss_sums,
    train_metrics=train_metrics,
    eval_metrics=eval_metrics,
    record_kind=lambda c: "text",
    derive=derive,
  )
)
