"""GRPO's reward metrics are TRL 1.16's (nanmean reward, the batch's nanstd), the rollouts sample with TRL's defaults
and the loss scores the distribution they sample from, a batch without reward spread updates nothing (TRL's loss on
it compared), and the console line says what it logs (no kl when none is computed; DPO's margins readable)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.config import BASE_YML

from MaxLite.config import load_config
from MaxLite.models import sampling
from MaxLite.objectives import grpo
from MaxLite.training import grpo_run
from MaxLite.training.metrics import log_line

torch = pytest.importorskip("torch")
trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")


def _trl_reward_metrics(scores: np.ndarray, weights: list[float], g: int) -> dict[str, float]:
  """GRPOTrainer._generate_and_score_completions' reward, reward_std and frac_reward_zero_std (trl 1.16)."""
  per_func = torch.tensor(scores)
  rewards = (per_func * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
  rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
  std = trl_utils.nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g)
  return {
    "reward": torch.nanmean(rewards).item(),
    "reward_std": trl_utils.nanstd(rewards).item(),
    "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item(),
  }


def test_reward_metrics_are_trl_s_with_an_unscored_completion():
  """The issue's case: one completion no function scored. TRL leaves it out of `reward` (1.333); counting it as 0
  gave 1.0. reward_std is the batch's spread, not the mean spread within groups."""
  nan = np.nan
  scores = np.array([[1, 1], [nan, nan], [0, 1], [1, 0], [0.3, 0.3], [0.3, 0.3]], np.float32)
  ours = grpo_run.reward_metrics(["a", "b"], scores, [1.0, 1.0], 2)
  trl = _trl_reward_metrics(scores, [1.0, 1.0], 2)
  assert ours["reward"] == pytest.approx(trl["reward"], rel=1e-6)
  assert ours["reward_std"] == pytest.approx(trl["reward_std"], rel=1e-6)
  assert ours["frac_reward_zero_std"] == pytest.approx(trl["frac_reward_zero_std"]) == 2 / 3
  # Without the last group (equal rewards): the numbers.
  assert grpo_run.reward_metrics(["a", "b"], scores[:4], [1.0, 1.0], 2)["reward"] == pytest.approx(4 / 3)


def test_a_group_of_equal_rewards_gets_advantage_exactly_zero():
  """0.3 six times: the group's mean differs from 0.3 by a rounding, which over (std + 1e-4) was an advantage of
  3e-4, enough for the step to take it for a signal."""
  rewards = np.full((12, 1), 0.3, np.float32)
  rewards[6:, 0] = [0, 1, 0, 1, 1, 0]
  advantages = grpo.group_advantages(rewards, [1.0], 6)
  assert np.all(advantages[:6] == 0.0) and np.all(advantages[6:] != 0.0)


def test_trl_s_loss_on_an_all_zero_advantage_batch_and_the_step_that_updates_nothing():
  """TRL's loss on a batch whose advantages are all 0 is 0 (beta 0) or beta times the KL; MaxLite's is the same. With
  the policy at its reference that KL's gradient is 0 but for roundings, which Adam scales to a full-size step:
  MaxLite makes no update from such a batch (objectives/grpo.py), whatever the gradient says."""
  rng = np.random.default_rng(0)
  rows, t = 4, 5
  mask = np.ones((rows, t), np.float32)
  log_p = -rng.gamma(2.0, 0.7, (rows, t)).astype(np.float32)
  ref = (log_p + rng.normal(0, 1e-6, (rows, t))).astype(np.float32)  # the reference, but for roundings
  zeros = np.zeros(rows, np.float32)
  for beta in (0.0, 0.04):
    torch_log_p = torch.tensor(log_p, requires_grad=True)
    stub = types.SimpleNamespace(
      _get_per_token_logps_and_entropies=lambda *a, lp=torch_log_p, **k: (lp, torch.zeros_like(lp), None),
      aux_loss_enabled=False,
      top_entropy_quantile=1.0,
      off_policy_mask_threshold=None,
      importance_sampling_level="token",
      beta=beta,
      loss_type="grpo",
      epsilon_low=0.2,
      epsilon_high=0.2,
      use_vllm=False,
      vllm_importance_sampling_correction=False,
      model=types.SimpleNamespace(training=True),
      current_gradient_accumulation_steps=1,
      _entropy_bonus_enabled=False,
      _metrics={"train": __import__("collections").defaultdict(list)},
      accelerator=types.SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction: x, num_processes=1),
      max_completion_length=t,
      args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
    )
    inputs = {
      "prompt_ids": torch.zeros((rows, 1), dtype=torch.long),
      "prompt_mask": torch.ones((rows, 1), dtype=torch.long),
      "completion_ids": torch.zeros((rows, t), dtype=torch.long),
      "completion_mask": torch.tensor(mask),
      "advantages": torch.tensor(zeros),
      "ref_per_token_logps": torch.tensor(ref),
    }
    trl_loss = trl_grpo.GRPOTrainer._compute_loss(stub, None, inputs)
    per_token, _ = grpo.token_losses(
      jnp.asarray(log_p),
      jnp.asarray(log_p),
      jnp.asarray(ref) if beta else None,
      jnp.asarray(zeros),
      jnp.asarray(mask),
      epsilon_low=0.2,
      epsilon_high=0.2,
      beta=beta,
      loss_algo="grpo",
    )
    total, count = grpo.aggregate(per_token, jnp.asarray(mask), "sequence-mean-token-mean")
    np.testing.assert_allclose(float(total / count), trl_loss.item(), rtol=1e-5, atol=1e-12)
    if beta == 0.0:
      assert float(trl_loss) == 0.0 and float(total) == 0.0
  assert not bool(grpo.updates({"advantages": jnp.zeros((rows, t))}))
  assert bool(grpo.updates({"advantages": jnp.zeros((rows, t)).at[2, :].set(1e-3)}))


def _rollout_config(**keys):
  return types.SimpleNamespace(
    rollout_temperature=keys.get("temperature", 1.0),
    rollout_top_k=keys.get("top_k", 0),
    rollout_top_p=keys.get("top_p", 1.0),
    # decode.py's keys (the unfixed code sampled and scored with these): set alike, so that a test fails on what is
    # scored, not on a missing key
    decode_sampling_temperature=keys.get("temperature", 1.0),
    decode_sampling_top_k=keys.get("top_k", 0),
    decode_sampling_nucleus_p=keys.get("top_p", 1.0),
    num_iterations=2,
    grpo_beta=0.0,
    grpo_epsilon=0.2,
    epsilon_high=-1.0,
    loss_algo="grpo",
    loss_agg_mode="token-mean",
  )


def test_rollouts_sample_with_trl_s_defaults(monkeypatch):
  """use_grpo=true alone: temperature 1.0, every token (top_k 0, top_p 1.0), as TRL's GRPOConfig; the keys set
  otherwise reach the sampler."""
  seen = {}
  monkeypatch.setattr(sampling, "make_rollout", lambda model, **kw: seen.update(kw))
  monkeypatch.setattr(grpo_run.build, "model", lambda *a, **k: None)
  for extra, want in (((), (1.0, 0, 1.0)), (("rl.rollout_top_k=50", "rollout_temperature=0.9"), (0.9, 50, 1.0))):
    config = load_config([BASE_YML, "use_grpo=true", *extra], num_devices=1)
    grpo_run.rollout_function(config, 1, None, (None, None), None)
    assert (seen["temperature"], seen["top_k"], seen["top_p"]) == want


@pytest.mark.slow
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (5, 0.8)])
def test_the_loss_scores_the_distribution_the_rollout_samples(top_k, top_p):
  """log pi(token) in the loss is the log-probability of the sampler's own distribution (temperature, then top-k,
  then top-p, renormalised), and stays finite for a sampled token the training pass ranks just outside the cut."""
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(0, 2, (2, 3, 11)).astype(np.float32))
  config = _rollout_config(temperature=0.7, top_k=top_k, top_p=top_p)
  drawn = sampling.sampling_logits(logits.reshape(6, 11), 0.7, top_k, top_p).reshape(2, 3, 11)
  sampler = jax.nn.log_softmax(drawn, axis=-1)
  targets = jnp.argmax(logits, axis=-1)  # always inside the cut
  sampled = jnp.take_along_axis(sampler, targets[..., None], -1)[..., 0]
  # The step's ratio pi / pi_old against the sampler's own log-probabilities is 1 on every token: loss -A exactly.
  batch = {"targets": targets, "targets_segmentation": jnp.ones((2, 3), jnp.int32), "old_log_probs": sampled}
  sums = grpo.token_loss_sums(logits, batch | {"advantages": jnp.ones((2, 3))}, config)
  np.testing.assert_allclose(float(sums["loss_sum"] / sums["count"]), -1.0, rtol=1e-6)
  got = grpo.completion_log_probs(logits, targets, config)
  np.testing.assert_allclose(got, sampled, rtol=1e-5, atol=1e-6)
  least = jnp.argmin(logits, axis=-1)  # outside any cut: finite, and its gradient too
  value, grad = jax.value_and_grad(lambda x: grpo.completion_log_probs(x, least, config).sum())(logits)
  assert np.isfinite(float(value)) and np.all(np.isfinite(grad))


def test_the_console_says_what_grpo_and_dpo_log():
  base = {"step": 3, "loss": 0.0, "learning_rate": 1e-3, "grad_norm": 0.1, "step_time_s": 1.0, "tokens_per_s": 10.0}
  base["tflops_per_device"] = 0.1
  grpo_row = base | {"reward": 1.333, "completions/mean_length": 12.0}
  grpo_row |= {"rewards/exact_match/mean": 0.333, "rewards/format_reward/mean": 1.0}
  line = log_line(grpo_row)  # grpo_beta=0: no kl computed, none printed
  assert "kl" not in line and "reward 1.333 (weighted sum of exact_match 0.333, format_reward 1.000)" in line
  assert "kl 0.0123" in log_line(grpo_row | {"kl": 0.0123})
  dpo_row = base | {"rewards/accuracies": 0.5, "rewards/margins": -0.000123}
  assert "margins -0.000123" in log_line(dpo_row)
