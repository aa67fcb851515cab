"""Odds ratio preference optimisation (Hong et al. 2024), TRL's ORPOTrainer's loss and metrics: `use_dpo=true
dpo_algo=orpo` (MaxText's dpo.algo), on the same preference pairs as DPO and with no reference model.

For a pair with mean response log-probabilities c (chosen) and r (rejected) under the policy (TRL's
average_log_prob=True), the log odds ratio is

    log_odds = (c - r) - (log(1 - e^c) - log(1 - e^r))

and the loss of a batch is the chosen sequences' next-token cross-entropy (over the prompt and the chosen response,
averaged over their tokens) minus orpo_lambda times the mean over pairs of log sigmoid(log_odds). The two means have
different denominators (tokens and pairs), both counted over the whole batch before it is split into microbatches
(`prepare`), so microbatches and shards add up to the same loss and gradient as TRL's on the whole batch. Metrics as
TRL names them: rewards/* = orpo_lambda * the mean log-probabilities, logps/*, nll_loss, log_odds_ratio (the mean of
log sigmoid(log_odds)) and log_odds_chosen (the mean log_odds). TRL's logits/chosen and logits/rejected (means over
padded logit tensors) are not logged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from MaxLite.cli.errors import ConfigError
from MaxLite.config import objectives, post_training
from MaxLite.config.choices import DPO_COLUMNS
from MaxLite.objectives import dpo
from MaxLite.runtime.lazy import jax, jnp


class Orpo(BaseModel):
  """ORPO (MaxText's dpo.orpo_lambda; TRL's ORPOConfig beta)."""

  nested_under: ClassVar[str] = "dpo"  # MaxText's `dpo:` group (config/maxtext_compat.py)

  orpo_lambda: float = Field(
    0.1, gt=0, description="ORPO (dpo_algo=orpo): weight of the odds-ratio term against the chosen NLL"
  )


KEY_GROUPS = (Orpo,)
PAIR_METRICS = (
  "rewards/chosen",
  "rewards/rejected",
  "rewards/accuracies",
  "rewards/margins",
  "logps/chosen",
  "logps/rejected",
  "log_odds_ratio",
  "log_odds_chosen",
)


def selects(c: Mapping[str, Any]) -> bool:
  return bool(c["use_dpo"]) and c["dpo_algo"] == "orpo"


def derive(c: dict[str, Any]) -> dict[str, Any]:
  out = post_training.derive_records(c, DPO_COLUMNS, "use_dpo")
  explicit = set(c.get("explicit_keys", ()))
  for key in ("dpo_beta", "dpo_label_smoothing"):
    if key in explicit:
      raise ConfigError(f"{key} is DPO's; dpo_algo=orpo weighs its odds-ratio term by orpo_lambda (TRL's ORPO beta)")
  if c["num_vocab_tiling"] > 1:
    raise ConfigError("dpo_algo=orpo needs num_vocab_tiling=1 (ORPO averages log-probabilities per response)")
  return out


def log1mexp(x: jax.Array) -> jax.Array:
  """log(1 - e^x) for x < 0, as TRL computes it (branching at -ln 2 to avoid cancellation)."""
  return jnp.where(x < -0.6931471805599453, jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def chosen_token_mask(batch: dict[str, jax.Array]) -> jax.Array:
  """1.0 where the target belongs to a chosen sequence (odd segment: the prompt and the chosen response) of a pair
  whose two responses both have tokens: TRL's NLL covers the prompt too."""
  segments = batch["inputs_segmentation"]
  ones = jnp.ones(segments.shape, jnp.float32)
  _, _, valid = dpo.response_log_probs(ones, batch["targets_segmentation"])
  pair = jnp.clip((segments - 1) // 2, 0, valid.shape[1] - 1)
  pair_valid = jnp.take_along_axis(valid, pair, axis=1)
  return ((segments % 2 == 1) & (segments > 0)).astype(jnp.float32) * pair_valid


def prepare(batch: dict[str, jax.Array], config: Any) -> dict[str, jax.Array]:
  """The whole batch's NLL tokens over its pairs, one value per row, so a microbatch's sums use the batch's means."""
  del config
  tokens = jnp.sum(chosen_token_mask(batch))
  _, _, valid = dpo.response_log_probs(jnp.zeros(batch["targets"].shape, jnp.float32), batch["targets_segmentation"])
  scale = jnp.sum(valid) / jnp.maximum(tokens, 1.0)
  return batch | {"orpo_nll_scale": jnp.full(batch["targets"].shape[:1], scale, jnp.float32)}


def orpo_sums(token_log_p: jax.Array, batch: dict[str, jax.Array], orpo_lambda: float) -> dict[str, jax.Array]:
  """ORPO's terms summed over the batch's valid pairs (and its chosen tokens for the NLL), from the log-probability of
  every target."""
  segments = batch["targets_segmentation"]
  chosen_sum, rejected_sum, valid = dpo.response_log_probs(token_log_p, segments)
  counts_chosen, counts_rejected, _ = dpo.response_log_probs(jnp.ones(token_log_p.shape, jnp.float32), segments)
  chosen = chosen_sum / jnp.maximum(counts_chosen, 1.0)
  rejected = rejected_sum / jnp.maximum(counts_rejected, 1.0)
  # Padding pairs read log1mexp(0) = -inf: their values are replaced before anything is summed.
  chosen, rejected = jnp.where(valid > 0, chosen, -1.0), jnp.where(valid > 0, rejected, -1.0)
  log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
  ratio = jax.nn.log_sigmoid(log_odds)
  nll_mask = chosen_token_mask(batch)
  chosen_reward, rejected_reward = orpo_lambda * chosen, orpo_lambda * rejected

  def total(x: jax.Array) -> jax.Array:
    return jnp.sum(x * valid)

  return {
    "nll_sum": jnp.sum(-token_log_p * nll_mask),
    "nll_tokens": jnp.sum(nll_mask),
    "odds_sum": total(ratio),
    "rewards/chosen": total(chosen_reward),
    "rewards/rejected": total(rejected_reward),
    "rewards/accuracies": total((chosen_reward > rejected_reward).astype(jnp.float32)),
    "rewards/margins": total(chosen_reward - rejected_reward),
    "logps/chosen": total(chosen),
    "logps/rejected": total(rejected),
    "log_odds_ratio": total(ratio),
    "log_odds_chosen": total(log_odds),
    "pairs": jnp.sum(valid),
  }


def loss_sums(params: Any, reference: Any, apply_fn: Any, batch: dict[str, jax.Array], rng: jax.Array, config: Any):
  """(total, sums): total / pairs is the batch's ORPO loss (module docstring), whatever the microbatch."""
  del reference
  from MaxLite.objectives import cross_entropy

  logits, _ = cross_entropy.forward(params, apply_fn, batch, rng)
  token_log_p, _ = cross_entropy.target_log_probs(logits, batch["targets"])
  sums = orpo_sums(token_log_p, batch, config.orpo_lambda)
  scale = (
    batch["orpo_nll_scale"][0] if "orpo_nll_scale" in batch else sums["pairs"] / jnp.maximum(sums["nll_tokens"], 1)
  )
  loss_sum = sums["nll_sum"] * scale - config.orpo_lambda * sums["odds_sum"]
  return loss_sum, sums | {
    "loss_sum": loss_sum,
    "count": sums["pairs"],
    "tokens": jnp.sum(batch["targets_segmentation"] != 0),
  }


def train_metrics(sums: dict[str, Any], count: Any) -> dict[str, Any]:
  nll = sums["nll_sum"] / jnp.maximum(sums["nll_tokens"], 1.0)
  return {k: sums[k] / count for k in PAIR_METRICS} | {"nll_loss": nll, "pairs": sums["pairs"]}


def eval_metrics(totals: dict[str, Any], config: Any) -> dict[str, float]:
  """The loss of the eval batches taken as one batch (TRL averages per-batch losses)."""
  pairs, tokens = max(totals["pairs"], 1.0), max(totals["nll_tokens"], 1.0)
  nll = totals["nll_sum"] / tokens
  return {"eval_loss": nll - config.orpo_lambda * totals["odds_sum"] / pairs, "eval_nll_loss": nll} | {
    f"eval_{k}": totals[k] / pairs for k in PAIR_METRICS
  }


OBJECTIVE = objectives.register(
  objectives.Objective(
    name="orpo",
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
    ensembles=False,
    prepare=prepare,
    logged=(*PAIR_METRICS, "nll_loss", "pairs"),
  )
)
