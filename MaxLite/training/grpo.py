"""Group relative policy optimisation (Shao et al. 2024) and GSPO-token (Zheng et al. 2025): the math, as TRL's.

A GRPO batch row is one completion: the prompt, then the sampled completion, then padding. targets_segmentation is
1 on the positions whose target is a completion token (the end-of-sequence token included) and 0 elsewhere, so the
per-token log-probabilities below line up with the completion and the prompt never counts. Rows come in groups of
num_generations completions of one prompt, adjacent.

For completion i, token t, with r = pi(t) / pi_old(t) (pi_old: the policy that sampled the batch) and A_i the group
relative advantage (the reward less its group's mean, over the group's standard deviation + 1e-4):

    loss_it = -min(r * A_i, clip(r, 1 - eps_low, 1 + eps_high) * A_i) + beta * (pi_ref/pi - log(pi_ref/pi) - 1)

With loss_algo=gspo-token r is the sequence's ratio, exp(mean_t log(pi/pi_old)), carried by each token:
sg[ratio] * pi(t) / sg[pi(t)], so its value is the sequence's and its gradient the token's. TRL's
importance_sampling_level="sequence" gives the same loss and the same gradient for every aggregation here.

loss_agg_mode (MaxText's names; TRL's loss_type in brackets) turns the token losses into the step's loss:
  sequence-mean-token-mean  each completion's mean over its tokens, averaged over completions ["grpo"];
  token-mean                the mean over every completion token of the batch ["bnpo"; "dapo" on one process];
  sequence-mean             each completion's sum over its tokens, averaged over completions ["luspo"].
Each is returned as a sum and a count (completions, or tokens), so microbatches and shards add up exactly and the
step divides once, as it does for the pretraining loss.

pi is the distribution the rollouts sample from (rollout_temperature, rollout_top_k, rollout_top_p; TRL's defaults:
1.0, off, off): the logits over the temperature, cut to the top-k/top-p tokens and renormalised, the sampled token
always kept. TRL scores the tempered distribution whatever top_k/top_p say (its vLLM path reports the truncated one
only for its importance-sampling correction); scoring what was sampled keeps the ratio an importance weight of the
sampling policy, and keeping the sampled token keeps its log-probability finite where the training forward pass
ranks it just outside the cut (roundings, or a later iteration's policy).

A batch in which every advantage is 0 (every group's rewards equal: a model that never earns a reward, or always
does) carries no policy gradient, only the KL term's, which is 0 but for roundings while the policy is its reference.
Adam scales such a gradient up to a full-size step, so the train step makes no update at all from it (`updates`):
params, optimizer state and the update count stay as they were. TRL computes the same loss (0, plus beta * KL) and
still calls optimizer.step(): from a fresh optimizer with exactly zero gradients that is also no move, but with
earlier steps' momentum, weight decay or a rounding-sized KL gradient it moves the weights on no evidence.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from MaxLite.models import sampling
from MaxLite.training import loss as loss_lib

# TRL's epsilon in the advantage's denominator: a group whose rewards are all equal gets advantage 0, not NaN.
ADVANTAGE_EPSILON = 1e-4
# Per-step metrics, each a sum over completion tokens here and a mean per token when logged.
TOKEN_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
# Every GRPO metric of a step's row (training/grpo_run.py adds the rewards, completion lengths and rollout speed).
METRIC_PREFIXES = ("kl", "entropy", "clip_ratio/", "reward", "frac_reward", "completions/", "rollout_")


def weighted_total(rewards: np.ndarray, weights: Sequence[float]) -> np.ndarray:
  """Each completion's weighted sum of its rewards [completions, functions], unscored (NaN) ones left out."""
  return np.nansum(np.asarray(rewards, np.float32) * np.asarray(weights, np.float32)[None, :], axis=1)


def group_advantages(rewards: np.ndarray, weights: Sequence[float], num_generations: int) -> np.ndarray:
  """Advantages [completions] from rewards [completions, functions] (NaN: a function that returned None for that
  completion, left out as TRL's nansum does): the weighted sum, less its group's mean, over its group's unbiased
  standard deviation + ADVANTAGE_EPSILON. A completion no function scored gets advantage 0 and no part in its group's
  statistics."""
  grouped = scored_totals(rewards, weights).reshape(-1, num_generations)
  with warnings.catch_warnings():  # an all-NaN group (no completion scored) is expected here
    warnings.simplefilter("ignore", RuntimeWarning)
    mean = np.nanmean(grouped, axis=1, keepdims=True)
    std = np.nanstd(grouped, axis=1, keepdims=True, ddof=1)
    # A group of equal rewards gets exactly 0 (its mean can differ from them by a rounding, which the epsilon would
    # turn into an advantage of up to ~1e-3): the train step then knows it carries nothing (module docstring).
    equal = np.nanmax(grouped, axis=1, keepdims=True) == np.nanmin(grouped, axis=1, keepdims=True)
  advantages = np.where(equal, 0.0, (grouped - mean) / (std + ADVANTAGE_EPSILON)).reshape(-1)
  return np.where(np.isnan(advantages), 0.0, advantages).astype(np.float32)


def scored_totals(rewards: np.ndarray, weights: Sequence[float]) -> np.ndarray:
  """Each completion's weighted reward sum [completions], NaN for a completion no function scored (as TRL's)."""
  rewards = np.asarray(rewards, np.float32)
  total = weighted_total(rewards, weights)
  total[np.isnan(rewards).all(axis=1)] = np.nan
  return total


def updates(batch: dict[str, jax.Array]) -> jax.Array:
  """Whether a GRPO batch may move the policy: some completion has a non-zero advantage (module docstring)."""
  return jnp.any(batch["advantages"] != 0)


def token_losses(
  log_p: jax.Array,
  old_log_p: jax.Array,
  ref_log_p: jax.Array | None,
  advantages: jax.Array,
  mask: jax.Array,
  *,
  epsilon_low: float,
  epsilon_high: float,
  beta: float,
  loss_algo: str,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(per-token loss [rows, positions], per-token metric terms), from the log-probabilities of each row's targets
  under the policy, the sampling policy and the reference (None when beta is 0), the advantages [rows] and the
  completion mask [rows, positions] (module docstring)."""
  log_ratio = log_p - old_log_p
  if loss_algo == "gspo-token":
    sequence = jnp.sum(log_ratio * mask, axis=-1, keepdims=True) / jnp.maximum(jnp.sum(mask, -1, keepdims=True), 1.0)
    log_weight = jax.lax.stop_gradient(sequence) + log_p - jax.lax.stop_gradient(log_p)
  else:
    log_weight = log_ratio
  ratio = jnp.exp(log_weight)
  advantage = advantages[:, None]
  clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
  loss = -jnp.minimum(ratio * advantage, clipped * advantage)
  low = ((ratio < 1.0 - epsilon_low) & (advantage < 0)).astype(jnp.float32)
  high = ((ratio > 1.0 + epsilon_high) & (advantage > 0)).astype(jnp.float32)
  terms = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": jnp.maximum(low, high)}
  if ref_log_p is not None:
    # Schulman's unbiased, always non-negative estimator of KL(pi || pi_ref), as TRL.
    kl = jnp.exp(ref_log_p - log_p) - (ref_log_p - log_p) - 1.0
    loss = loss + beta * kl
    terms["kl"] = kl
  return loss, terms


def aggregate(loss: jax.Array, mask: jax.Array, mode: str) -> tuple[jax.Array, jax.Array]:
  """(sum, count) of the token losses under loss_agg_mode (module docstring): loss = sum / count over the batch."""
  rows = jnp.asarray(loss.shape[0], jnp.float32)
  if mode == "token-mean":
    return jnp.sum(loss * mask), jnp.sum(mask)
  if mode == "sequence-mean":
    return jnp.sum(loss * mask), rows
  if mode == "sequence-mean-token-mean":
    return jnp.sum(jnp.sum(loss * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)), rows
  raise ValueError(f"unknown loss_agg_mode {mode!r}")


def entropy(logits: jax.Array) -> jax.Array:
  """The entropy of each position's next-token distribution [rows, positions], in float32 (-inf logits: cut tokens)."""
  log_q = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.where(jnp.isfinite(log_q), jnp.exp(log_q) * log_q, 0.0), axis=-1)


def batch_keys(config: Any) -> tuple[str, ...]:
  """The float32 [rows, positions] arrays a GRPO batch holds beside the token arrays (training/grpo_run.py makes
  them): the advantages, and as the config needs them the sampling policy's and the reference's log-probabilities."""
  return (
    "advantages",
    *(("old_log_probs",) if config.num_iterations > 1 else ()),
    *(("ref_log_probs",) if config.grpo_beta > 0 else ()),
  )


def scoring_logits(logits: jax.Array, targets: jax.Array, config: Any) -> jax.Array:
  """The logits [rows, positions, vocab] of the distribution the completions were sampled from, in float32: over
  rollout_temperature, cut by rollout_top_k/rollout_top_p as the sampler cuts them, each position's target kept
  (module docstring)."""
  truncated = config.rollout_top_k > 0 or config.rollout_top_p < 1.0
  keep = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.bool_) if truncated else None
  return sampling.sampling_logits(logits, config.rollout_temperature, config.rollout_top_k, config.rollout_top_p, keep)


def completion_log_probs(logits: jax.Array, targets: jax.Array, config: Any) -> jax.Array:
  """log pi(target) at every position [rows, positions], in float32, under the sampling distribution
  (scoring_logits)."""
  return loss_lib.target_log_probs(scoring_logits(logits, targets, config), targets)[0]


def loss_sums(logits: jax.Array, batch: dict[str, jax.Array], config: Any) -> dict[str, jax.Array]:
  """GRPO's loss and metrics summed over the batch (module docstring), from the policy's logits on a GRPO batch
  (training/grpo_run.py's rows, with their advantages and, as the config needs them, the sampling policy's and the
  reference's log-probabilities). "count" is what the loss is a sum over; "tokens" the completion tokens."""
  mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  scored = scoring_logits(logits, batch["targets"], config)
  log_p = loss_lib.target_log_probs(scored, batch["targets"])[0]
  old = batch["old_log_probs"] if config.num_iterations > 1 else jax.lax.stop_gradient(log_p)
  epsilon_high = config.grpo_epsilon if config.epsilon_high == -1.0 else config.epsilon_high
  per_token, terms = token_losses(
    log_p,
    old,
    batch.get("ref_log_probs"),
    batch["advantages"][:, 0],
    mask,
    epsilon_low=config.grpo_epsilon,
    epsilon_high=epsilon_high,
    beta=config.grpo_beta,
    loss_algo=config.loss_algo,
  )
  total, count = aggregate(per_token, mask, config.loss_agg_mode)
  terms["entropy"] = jax.lax.stop_gradient(entropy(scored))
  sums = {name: jnp.sum(jax.lax.stop_gradient(value) * mask) for name, value in terms.items()}
  return sums | {"loss_sum": total, "count": count, "tokens": jnp.sum(mask)}
