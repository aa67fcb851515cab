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

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from MaxLite.cli.errors import ConfigError
from MaxLite.config import objectives, post_training
from MaxLite.config.choices import DPO_COLUMNS
from MaxLite.runtime.lazy import jax, jnp


class Dpo(BaseModel):
  """DPO and ORPO on preference pairs (MaxText's keys). In a YAML file they may also sit under `dpo:` and on the
  command line be written dpo.KEY=VALUE, as MaxText's post_train/dpo.yml does (dpo.algo is dpo_algo)."""

  nested_under: ClassVar[str] = "dpo"  # MaxText's `dpo:` group (config/maxtext_compat.py)

  use_dpo: bool = Field(
    False,
    description="preference optimisation on chosen/rejected pairs (dpo_algo); DPO's reference is load_parameters_path",
  )
  dpo_algo: str = Field(
    "dpo",
    description="the preference objective: dpo (against a frozen reference), or another registered under use_dpo",
    json_schema_extra={"nested_as": "algo"},  # MaxText's dpo.algo
  )
  dpo_beta: float = Field(0.1, description="DPO: how strongly the policy is held to the reference")
  dpo_label_smoothing: float = Field(
    0.0,
    description="DPO: the chance a pair's label is wrong (conservative DPO), in [0, 0.5)",
  )


KEY_GROUPS = (Dpo,)

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


def reference_log_probs(reference: Any, batch: dict[str, jax.Array], config: Any) -> tuple[jax.Array, jax.Array]:
  """(chosen, rejected), each [batch, pairs]: the frozen reference's summed log-probabilities of each pair's
  responses, from its own deterministic forward pass (no dropout, no gradient). With LoRA the reference is the frozen
  base with the adapters off: the model without them, so no second copy of the weights exists."""
  from MaxLite.models import build
  from MaxLite.objectives import cross_entropy

  logits = build.model(config, adapters=False).apply(
    {"params": jax.lax.stop_gradient(reference)},
    batch["inputs"],
    batch["inputs_position"],
    batch["inputs_segmentation"],
  )
  log_p, _ = cross_entropy.target_log_probs(logits, batch["targets"])
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


def selects(c: Mapping[str, Any]) -> bool:
  return bool(c["use_dpo"]) and c["dpo_algo"] == "dpo"


def derive(c: dict[str, Any]) -> dict[str, Any]:
  """The preference columns; the reference is the loaded checkpoint, so one must be named."""
  out = post_training.derive_records(c, DPO_COLUMNS, "use_dpo")
  post_training.starts_from_a_checkpoint(
    c, "use_dpo", "the loaded parameters are the frozen reference model and the start"
  )
  if c["num_vocab_tiling"] > 1:
    raise ConfigError("use_dpo=true needs num_vocab_tiling=1 (DPO sums log-probabilities per response)")
  if not 0.0 <= c["dpo_label_smoothing"] < 0.5:
    raise ConfigError(f"dpo_label_smoothing must be in [0, 0.5), got {c['dpo_label_smoothing']}")
  if c["dpo_beta"] <= 0:
    raise ConfigError(f"dpo_beta must be positive, got {c['dpo_beta']}")
  return out


def policy_log_probs(params: Any, apply_fn: Any, batch: dict[str, jax.Array], rng: jax.Array) -> tuple:
  """(chosen, rejected, valid) of the policy, and its logits."""
  from MaxLite.objectives import cross_entropy

  logits, _ = cross_entropy.forward(params, apply_fn, batch, rng)
  log_p, _ = cross_entropy.target_log_probs(logits, batch["targets"])
  return (*response_log_probs(log_p, batch["targets_segmentation"]), logits)


def loss_sums(params: Any, reference: Any, apply_fn: Any, batch: dict[str, jax.Array], rng: jax.Array, config: Any):
  """DPO's loss and metrics summed over the batch's preference pairs."""
  chosen, rejected, valid, _ = policy_log_probs(params, apply_fn, batch, rng)
  # The reference's own forward pass: without dropout, whatever dropout_rate (the module docstring).
  ref_chosen, ref_rejected = reference_log_probs(reference, batch, config)
  sums = dpo_sums((chosen, rejected), (ref_chosen, ref_rejected), valid, config.dpo_beta, config.dpo_label_smoothing)
  sums.update(loss_sum=sums["dpo_loss_sum"], count=sums["pairs"], tokens=jnp.sum(batch["targets_segmentation"] != 0))
  return sums["loss_sum"], sums


def train_metrics(sums: dict[str, Any], count: Any) -> dict[str, Any]:
  return {k: sums[k] / count for k in REWARD_METRICS} | {"pairs": sums["pairs"]}


def eval_metrics(totals: dict[str, Any], config: Any) -> dict[str, float]:
  del config
  pairs = max(totals["pairs"], 1.0)
  return {"eval_loss": totals["dpo_loss_sum"] / pairs} | {f"eval_{k}": totals[k] / pairs for k in REWARD_METRICS}


def keeps_reference(config: Any) -> bool:
  """A frozen copy of the start, unless LoRA's frozen base is the reference already."""
  return not config.enable_lora


OBJECTIVE = objectives.register(
  objectives.Objective(
    name="dpo",
    flag="use_dpo",
    selects=selects,
    loss_sums=loss_sums,
    train_metrics=train_metrics,
    eval_metrics=eval_metrics,
    record_kind=lambda c: post_training.data_kind(c["train_data_columns"]),
    derive=derive,
    reads_records=True,
    min_segments=2,
    whole_logits=True,
    reference=keeps_reference,
    reads_reference=True,
    ensembles=False,
    logged=(*REWARD_METRICS, "pairs"),
  )
)
