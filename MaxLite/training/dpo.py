"""Direct preference optimisation (Rafailov et al. 2023): the loss and TRL's reward metrics, summed over pairs.

A DPO batch row holds whole preference pairs (data/packing.py): pair p of a row is segment 2p+1 (the prompt and the
chosen response) followed by segment 2p+2 (the prompt and the rejected one). targets_segmentation is the segment id on
response tokens and 0 elsewhere, so a response's log-probability is the sum of its tokens' log-probabilities over the
positions of its segment id, and the prompt never counts.

With label smoothing eps (the paper's conservative DPO, cDPO: each label is wrong with probability eps)

    loss = -(1 - eps) log sigma(beta * delta) - eps log sigma(-beta * delta),
    delta = (log pi(chosen) - log pi_ref(chosen)) - (log pi(rejected) - log pi_ref(rejected)).

Everything is a sum over the pairs of the batch (as the pretraining loss is over tokens), so microbatches and shards
add up exactly; the step divides by the number of pairs. The implicit rewards are beta * (log pi - log pi_ref).

The reference is a fixed function of the data: its forward pass never drops activations, whatever dropout_rate
(TRL runs its reference model in eval mode), so pi_ref is the same for a pair at every step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from MaxLite.config import Config
from MaxLite.models import build
from MaxLite.training import loss

# TRL's names for the implicit-reward metrics (each a sum over pairs in dpo_sums; a mean per pair when logged).
REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
# A pair's margin within this fraction of its four summed log-probabilities' magnitudes is a tie (8 float32 roundings):
# the policy's and the reference's forward passes are compiled apart (on a sharded mesh, partitioned apart too), so a
# policy equal to its reference differs from it by roundings, never by a preference.
TIE_RESOLUTION = 2.0**-20


def response_log_probs(token_log_probs: jax.Array, target_segments: jax.Array) -> tuple[jax.Array, ...]:
  """(chosen, rejected, valid), each [batch, pairs]: the summed log-probabilities of each pair's responses, and 1.0
  for pairs with at least one response token on both sides. pairs = seq_len // 2 bounds the pairs of a row."""
  num_pairs = max(target_segments.shape[1] // 2, 1)
  # Segment k >= 1 is response k-1 of the row: pair (k-1)//2, chosen when k is odd. Slot 2 * num_pairs takes padding.
  index = jnp.where(target_segments > 0, target_segments - 1, 2 * num_pairs)

  def per_row(values: jax.Array, ids: jax.Array) -> jax.Array:
    return jax.ops.segment_sum(values, ids, num_segments=2 * num_pairs + 1)[:-1].reshape(num_pairs, 2)

  sums = jax.vmap(per_row)(token_log_probs, index)
  counts = jax.vmap(per_row)((target_segments > 0).astype(jnp.float32), index)
  valid = ((counts[..., 0] > 0) & (counts[..., 1] > 0)).astype(jnp.float32)
  return sums[..., 0], sums[..., 1], valid


def reference_log_probs(reference: Any, batch: dict[str, jax.Array], config: Config) -> tuple[jax.Array, jax.Array]:
  """(chosen, rejected), each [batch, pairs]: the frozen reference's summed log-probabilities of each pair's
  responses, from its own deterministic forward pass (no dropout, no gradient). With LoRA the reference is the frozen
  base with the adapters off: the model without them, so no second copy of the weights exists."""
  logits = build.model(config, adapters=False).apply(
    {"params": jax.lax.stop_gradient(reference)},
    batch["inputs"],
    batch["inputs_position"],
    batch["inputs_segmentation"],
  )
  log_p, _ = loss.target_log_probs(logits, batch["targets"])
  chosen, rejected, _ = response_log_probs(log_p, batch["targets_segmentation"])
  return chosen, rejected


def dpo_sums(
  policy: tuple[jax.Array, jax.Array],
  reference: tuple[jax.Array, jax.Array],
  valid: jax.Array,
  beta: float,
  label_smoothing: float,
) -> dict[str, jax.Array]:
  """The loss and TRL's metrics summed over valid pairs, from (chosen, rejected) log-probabilities of the policy and
  the frozen reference; "pairs" counts them. rewards/accuracies counts the pairs whose chosen reward is higher: a tie
  is not a win, as in TRL ((chosen_rewards > rejected_rewards).float()), and a margin within rounding (TIE_RESOLUTION)
  is a tie."""
  chosen_reward = beta * (policy[0] - reference[0])
  rejected_reward = beta * (policy[1] - reference[1])
  logits = chosen_reward - rejected_reward
  magnitude = beta * (jnp.abs(policy[0]) + jnp.abs(policy[1]) + jnp.abs(reference[0]) + jnp.abs(reference[1]))
  wins = logits > TIE_RESOLUTION * magnitude
  losses = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(logits) - label_smoothing * jax.nn.log_sigmoid(-logits)
  return {
    "dpo_loss_sum": jnp.sum(losses * valid),
    "rewards/chosen": jnp.sum(chosen_reward * valid),
    "rewards/rejected": jnp.sum(rejected_reward * valid),
    "rewards/accuracies": jnp.sum(wins * valid),
    "rewards/margins": jnp.sum(logits * valid),
    "pairs": jnp.sum(valid),
  }
