"""AdamW with linear warmup + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax

from MaxLite.config import Config


def learning_rate_schedule(config: Config, peak: float | jax.Array | None = None) -> optax.Schedule:
  """Linear warmup from 0 to the peak (learning_rate, or an ensemble member's), then cosine down to the peak times
  learning_rate_final_fraction."""
  total = config.learning_rate_schedule_steps
  warmup = int(config.warmup_steps_fraction * total)
  peak = config.learning_rate if peak is None else peak
  cosine = optax.cosine_decay_schedule(peak, max(total - warmup, 1), alpha=config.learning_rate_final_fraction)
  if warmup == 0:
    return cosine
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), cosine], [warmup])


def _decay_mask(params):
  # Norm scales are gains, not weights: decaying them towards zero would fight the normalisation. Biases (Qwen's
  # q/k/v) are offsets, left undecayed as in the recipes that trained them. DeepSeek's routing bias is not trained by
  # the optimizer at all (train_step moves it); decay would pull it to zero.
  undecayed = ("scale", "bias", "score_correction_bias")
  return jax.tree_util.tree_map_with_path(
    lambda path, _: not any(getattr(k, "key", None) in undecayed for k in path), params
  )


def create_optimizer(config: Config, peak: float | jax.Array | None = None) -> optax.GradientTransformation:
  """AdamW (and clipping) as configured; `peak`: an ensemble member's peak learning rate, traced inside the step."""
  adamw = optax.adamw(
    learning_rate_schedule(config, peak),
    b1=config.adam_b1,
    b2=config.adam_b2,
    eps=config.adam_eps,
    weight_decay=config.adam_weight_decay,
    mask=_decay_mask,
  )
  if config.gradient_clipping_threshold > 0:
    return optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), adamw)
  return adamw
