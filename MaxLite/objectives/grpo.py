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

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field, model_validator

from MaxLite.cli.errors import ConfigError
from MaxLite.config import choices, objectives, post_training
from MaxLite.runtime.lazy import jax, jnp


class Grpo(BaseModel):
  """GRPO: reinforcement learning from rewards on sampled completions (MaxText's rl keys; TRL's math). In a YAML file
  they may also sit under `rl:` and on the command line be written rl.KEY=VALUE, as MaxText's post_train/rl.yml does."""

  nested_under: ClassVar[str] = "rl"  # MaxText's `rl:` group (config/maxtext_compat.py)

  use_grpo: bool = Field(
    False,
    description="GRPO on prompts (train_data_columns: the prompt first; the rest go to the reward functions)",
  )
  num_generations: int = Field(2, description="GRPO: completions sampled per prompt (G), >= 2; the batch holds them")
  num_iterations: int = Field(1, description="GRPO: updates per batch of completions (mu), >= 1")
  grpo_beta: float = Field(0.08, description="GRPO: weight of the KL penalty to the reference; 0 = no reference")
  grpo_epsilon: float = Field(0.2, description="GRPO: clip range of the probability ratio, below 1")
  epsilon_high: float = Field(-1.0, description="GRPO: clip range above 1 (DAPO's clip-higher); -1 = grpo_epsilon")
  loss_algo: Literal[choices.GRPO_LOSS_ALGOS] = Field(
    "grpo", description="grpo (token ratios) | gspo-token (the sequence's ratio per token)"
  )
  loss_agg_mode: Literal[choices.GRPO_LOSS_AGG_MODES] = Field(
    "sequence-mean-token-mean",
    description="sequence-mean-token-mean | token-mean | sequence-mean: how token losses make the batch's loss",
  )
  reward_functions: list[str] = Field(
    ["MaxLite.data.arithmetic:exact_match", "MaxLite.data.arithmetic:format_reward"],
    description="GRPO: module:function or file.py:function, each f(prompts, completions, **columns) -> scores",
  )
  reward_weights: list[float] = Field([], description="GRPO: one weight per reward function; [] = 1.0 each")
  # The rollouts' sampling, TRL's GRPOConfig temperature/top_k/top_p with its defaults. decode.py's decode_sampling_*
  # keys (MaxText's rl.yml sets those for its rollouts) are refused with use_grpo: their defaults truncate.
  rollout_temperature: float = Field(
    1.0, description="GRPO: rollout sampling temperature, > 0; the loss scores the same tempered distribution"
  )
  rollout_top_k: int = Field(0, description="GRPO: sample among the k most likely tokens; 0 = every token (TRL's)")
  rollout_top_p: float = Field(
    1.0, description="GRPO: sample among the most likely tokens whose mass reaches p, in (0, 1]; 1 = every token"
  )

  @model_validator(mode="after")
  def _in_range(self) -> Grpo:
    """Refused at load: each would fail only after the model is built, or silently learn nothing (one generation
    has no group to be relative to)."""
    if self.num_generations < 2:
      raise ConfigError(
        f"num_generations must be at least 2 (advantages are relative to the other completions of the same "
        f"prompt), got {self.num_generations}"
      )
    if self.num_iterations < 1:
      raise ConfigError(f"num_iterations must be at least 1, got {self.num_iterations}")
    if not self.grpo_beta >= 0.0:
      raise ConfigError(f"grpo_beta must be >= 0, got {self.grpo_beta}")
    if not 0.0 < self.grpo_epsilon < 1.0:
      raise ConfigError(f"grpo_epsilon must be in (0, 1), got {self.grpo_epsilon}")
    if not (self.epsilon_high == -1.0 or 0.0 < self.epsilon_high < math.inf):
      raise ConfigError(f"epsilon_high must be positive, or -1 for grpo_epsilon, got {self.epsilon_high}")
    # 0 would divide the logits by zero and a negative one favour the least likely tokens (NaN fails too).
    if not 0.0 < self.rollout_temperature < math.inf:
      raise ConfigError(
        f"rollout_temperature must be in (0, inf) (GRPO samples its completions at it), got {self.rollout_temperature}"
      )
    if self.rollout_top_k < 0:
      raise ConfigError(
        f"rollout_top_k must be >= 0 (0 = every token, else the k most likely), got {self.rollout_top_k}"
      )
    if not 0.0 < self.rollout_top_p <= 1.0:
      raise ConfigError(
        f"rollout_top_p must be in (0, 1] (probability mass kept; 1 = every token), got {self.rollout_top_p}"
      )
    if self.reward_weights and len(self.reward_weights) != len(self.reward_functions):
      raise ConfigError(
        f"reward_weights has {len(self.reward_weights)} weights for {len(self.reward_functions)} reward_functions; "
        "give one per function, or [] for 1.0 each"
      )
    if self.use_grpo and not self.reward_functions:
      raise ConfigError("use_grpo=true needs reward_functions (module:function entries)")
    return self


KEY_GROUPS = (Grpo,)

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
  from MaxLite.models import sampling

  return sampling.sampling_logits(logits, config.rollout_temperature, config.rollout_top_k, config.rollout_top_p, keep)


def completion_log_probs(logits: jax.Array, targets: jax.Array, config: Any) -> jax.Array:
  """log pi(target) at every position [rows, positions], in float32, under the sampling distribution
  (scoring_logits)."""
  from MaxLite.objectives import cross_entropy as loss_lib

  return loss_lib.target_log_probs(scoring_logits(logits, targets, config), targets)[0]


def token_loss_sums(logits: jax.Array, batch: dict[str, jax.Array], config: Any) -> dict[str, jax.Array]:
  """GRPO's loss and metrics summed over the batch (module docstring), from the policy's logits on a GRPO batch
  (training/grpo_run.py's rows, with their advantages and, as the config needs them, the sampling policy's and the
  reference's log-probabilities). "count" is what the loss is a sum over; "tokens" the completion tokens."""
  from MaxLite.objectives import cross_entropy as loss_lib

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


# decode.py's sampling keys -> GRPO's own; TRL's defaults for GRPO's.
ROLLOUT_KEYS = {
  "decode_sampling_temperature": "rollout_temperature",
  "decode_sampling_top_k": "rollout_top_k",
  "decode_sampling_nucleus_p": "rollout_top_p",
}
ROLLOUT_DEFAULTS = {"rollout_temperature": 1.0, "rollout_top_k": 0, "rollout_top_p": 1.0}


def selects(c: Mapping[str, Any]) -> bool:
  return bool(c["use_grpo"])


def derive(c: dict[str, Any]) -> dict[str, Any]:
  """GRPO's data: the user's prompt files, or with none named the shipped arithmetic problems (prompt + answer)."""
  if c["dataset_type"] != "grain":
    raise ConfigError("use_grpo=true reads prompts from files: set dataset_type=grain (with grain_train_files)")
  out: dict[str, Any] = {}
  explicit = set(c.get("explicit_keys", ()))
  for decode_key, rollout_key in ROLLOUT_KEYS.items():  # decode.py's keys, which MaxText's rl.yml reuses
    if decode_key in explicit:
      raise ConfigError(
        f"use_grpo=true samples its rollouts with {rollout_key} (TRL's default {ROLLOUT_DEFAULTS[rollout_key]}), "
        f"not {decode_key} (decode.py's): write {rollout_key}={c[decode_key]}"
      )
  if "grain_train_files" not in explicit:
    out.update(grain_train_files=choices.GRPO_SHIPPED_TRAIN, grain_file_type="jsonl")
    if "grain_eval_files" not in explicit:
      out["grain_eval_files"] = choices.GRPO_SHIPPED_EVAL
  shipped = out.get("grain_train_files", c["grain_train_files"]) == choices.GRPO_SHIPPED_TRAIN
  if not shipped and "reward_functions" not in explicit:
    raise ConfigError(
      "use_grpo=true on your own prompts (grain_train_files) needs reward_functions (module:function entries): "
      "the default ones score the shipped arithmetic problems"
    )
  default_columns = ["prompt", "answer"] if shipped else ["prompt"]
  train = list(c["train_data_columns"]) or default_columns
  out.update(train_data_columns=train, eval_data_columns=list(c["eval_data_columns"]) or train)
  post_training.check_chat_template(c)
  if c["num_vocab_tiling"] > 1:
    raise ConfigError("use_grpo=true needs num_vocab_tiling=1 (GRPO reads every completion token's log-probability)")
  if c["max_prefill_predict_length"] + c["max_decode_steps"] > c["max_target_length"]:
    raise ConfigError(
      f"use_grpo=true: max_prefill_predict_length={c['max_prefill_predict_length']} (the prompt) + "
      f"max_decode_steps={c['max_decode_steps']} (the completion) exceeds max_target_length={c['max_target_length']}"
    )
  return out


def check_mesh(c: Mapping[str, Any], mesh: Mapping[str, int], global_batch: int) -> None:
  """A GRPO batch is whole groups of num_generations completions, sampled on the training mesh (no pipeline)."""
  if global_batch % c["num_generations"]:
    raise ConfigError(
      f"use_grpo=true: the global batch of {global_batch} completions (per_device_batch_size x devices x "
      f"gradient_accumulation_steps) is not a multiple of num_generations={c['num_generations']}"
    )
  if mesh["stage"] > 1:
    raise ConfigError(
      "use_grpo=true samples with the KV-cache decoder, which does not pipeline: set ici/dcn_pipeline_parallelism=1"
    )


def loss_sums(params: Any, reference: Any, apply_fn: Any, batch: dict[str, jax.Array], rng: jax.Array, config: Any):
  """The policy's forward pass on the rollouts (their reference log-probabilities came with the batch)."""
  del reference
  from MaxLite.objectives import cross_entropy

  logits, _ = cross_entropy.forward(params, apply_fn, batch, rng)
  sums = token_loss_sums(logits, batch, config)
  return sums["loss_sum"], sums


def train_metrics(sums: dict[str, Any], count: Any) -> dict[str, Any]:
  """Per completion token, as TRL logs them."""
  del count
  return {k: sums[k] / jnp.maximum(sums["tokens"], 1.0) for k in TOKEN_METRICS if k in sums}


def eval_metrics(totals: dict[str, Any], config: Any) -> dict[str, float]:
  del config
  return {"eval_loss": totals["loss_sum"] / max(totals["count"], 1.0)}


def keeps_reference(config: Any) -> bool:
  """GRPO's KL penalty reads a frozen copy of the start (none with grpo_beta=0, as TRL loads no reference then;
  under LoRA the frozen base is the reference)."""
  return not config.enable_lora and config.grpo_beta > 0


OBJECTIVE = objectives.register(
  objectives.Objective(
    name="grpo",
    flag="use_grpo",
    selects=selects,
    loss_sums=loss_sums,
    train_metrics=train_metrics,
    eval_metrics=eval_metrics,
    record_kind=lambda c: "prompts",
    derive=derive,
    check_mesh=check_mesh,
    whole_logits=False,
    reference=keeps_reference,
    updates_per_batch=lambda c: c["num_iterations"],
    ensembles=False,
    rollouts=True,
    keeps_update=updates,
    batch_keys=batch_keys,
    logged=METRIC_PREFIXES,
  )
)
