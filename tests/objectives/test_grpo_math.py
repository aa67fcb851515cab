"""GRPO's math equals TRL's: for the same completions, rewards and log-probabilities, MaxLite's loss and its gradient
with respect to the policy's log-probabilities are trl.GRPOTrainer's (its own _compute_loss, run on them), for every
loss_agg_mode, loss_algo, beta 0 and > 0, one iteration (old log-probs = the policy's, detached) and two (old
log-probs from the sampling policy), and a clip range either side."""

from __future__ import annotations

import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxLite.objectives import grpo

torch = pytest.importorskip("torch")
trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

# MaxText's loss_agg_mode -> TRL's loss_type; MaxText's loss_algo -> TRL's importance_sampling_level.
TRL_LOSS_TYPE = {"sequence-mean-token-mean": "grpo", "token-mean": "bnpo", "sequence-mean": "luspo"}
TRL_LEVEL = {"grpo": "token", "gspo-token": "sequence"}
G, PROMPTS, T = 4, 3, 7


def _batch(seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  rows = G * PROMPTS
  lengths = rng.integers(1, T + 1, rows)
  lengths[0] = T  # one completion fills the window, one is a single token (its end-of-sequence)
  lengths[1] = 1
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
  log_p = -rng.gamma(2.0, 0.7, (rows, T)).astype(np.float32)
  old = (log_p + rng.normal(0, 0.3, (rows, T))).astype(np.float32)  # far enough apart for both clips to act
  ref = (log_p + rng.normal(0, 0.5, (rows, T))).astype(np.float32)
  rewards = rng.integers(0, 2, (rows, 2)).astype(np.float32)
  rewards[G : 2 * G] = 1.0  # a group whose rewards are all equal: advantage 0, not NaN
  rewards[3, 1] = np.nan  # a function that returned None for one completion
  rewards[5, :] = np.nan  # and a completion no function scored
  return {"mask": mask, "log_p": log_p, "old": old, "ref": ref, "rewards": rewards}


def _trl_advantages(rewards: np.ndarray, weights: list[float]) -> np.ndarray:
  """TRL's scale_rewards="group" advantages (GRPOTrainer._generate_and_score_completions), on its own nanstd."""
  per_func = torch.tensor(rewards)
  total = (per_func * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
  total[torch.isnan(per_func).all(dim=1)] = torch.nan
  mean = torch.nanmean(total.view(-1, G), dim=1).repeat_interleave(G)
  std = trl_utils.nanstd(total.view(-1, G), dim=1).repeat_interleave(G)
  advantages = (total - mean) / (std + 1e-4)
  return torch.nan_to_num(advantages, nan=0.0).numpy()


def _trl_loss_and_grad(b, advantages, *, mode, algo, beta, eps_high, iterations) -> tuple[float, np.ndarray]:
  log_p = torch.tensor(b["log_p"], requires_grad=True)
  stub = types.SimpleNamespace(
    _get_per_token_logps_and_entropies=lambda *a, **k: (log_p, torch.zeros_like(log_p), None),
    aux_loss_enabled=False,
    top_entropy_quantile=1.0,
    off_policy_mask_threshold=None,
    importance_sampling_level=TRL_LEVEL[algo],
    beta=beta,
    loss_type=TRL_LOSS_TYPE[mode],
    epsilon_low=0.2,
    epsilon_high=eps_high,
    use_vllm=False,
    vllm_importance_sampling_correction=False,
    model=types.SimpleNamespace(training=True),
    current_gradient_accumulation_steps=1,
    _entropy_bonus_enabled=False,
    _metrics={"train": __import__("collections").defaultdict(list)},
    accelerator=types.SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction: x, num_processes=1),
    max_completion_length=T,
    args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
  )
  inputs = {
    "prompt_ids": torch.zeros((len(log_p), 1), dtype=torch.long),
    "prompt_mask": torch.ones((len(log_p), 1), dtype=torch.long),
    "completion_ids": torch.zeros((len(log_p), T), dtype=torch.long),
    "completion_mask": torch.tensor(b["mask"]),
    "advantages": torch.tensor(advantages),
    "ref_per_token_logps": torch.tensor(b["ref"]),
  }
  if iterations > 1:
    inputs["old_per_token_logps"] = torch.tensor(b["old"])
  loss = trl_grpo.GRPOTrainer._compute_loss(stub, None, inputs)
  loss.backward()
  return float(loss), log_p.grad.numpy()


def _maxlite_loss_and_grad(b, advantages, *, mode, algo, beta, eps_high, iterations) -> tuple[float, np.ndarray]:
  mask = jnp.asarray(b["mask"])

  def loss_fn(log_p):
    old = jnp.asarray(b["old"]) if iterations > 1 else jax.lax.stop_gradient(log_p)
    ref = jnp.asarray(b["ref"]) if beta else None
    per_token, _ = grpo.token_losses(
      log_p,
      old,
      ref,
      jnp.asarray(advantages),
      mask,
      epsilon_low=0.2,
      epsilon_high=eps_high,
      beta=beta,
      loss_algo=algo,
    )
    total, count = grpo.aggregate(per_token, mask, mode)
    return total / count

  loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(b["log_p"]))
  return float(loss), np.asarray(grad)


def test_advantages_are_trl_s_with_unscored_completions_and_a_group_of_equal_rewards():
  b = _batch(0)
  weights = [1.0, 0.5]
  ours = grpo.group_advantages(b["rewards"], weights, G)
  np.testing.assert_allclose(ours, _trl_advantages(b["rewards"], weights), rtol=1e-5, atol=1e-6)
  assert np.all(ours[G : 2 * G] == 0.0) and ours[5] == 0.0


@pytest.mark.parametrize(
  "mode,algo",
  list(itertools.product(["sequence-mean-token-mean", "token-mean", "sequence-mean"], ["grpo", "gspo-token"])),
)
@pytest.mark.parametrize("beta,eps_high,iterations", [(0.0, 0.2, 1), (0.04, 0.2, 1), (0.0, 0.28, 2), (0.04, 0.28, 2)])
def test_loss_and_its_gradient_equal_trl_s(mode, algo, beta, eps_high, iterations):
  b = _batch(1)
  advantages = _trl_advantages(b["rewards"], [1.0, 1.0])
  kw = dict(mode=mode, algo=algo, beta=beta, eps_high=eps_high, iterations=iterations)
  trl_loss, trl_grad = _trl_loss_and_grad(b, advantages, **kw)
  loss, grad = _maxlite_loss_and_grad(b, advantages, **kw)
  assert np.any(trl_grad != 0)
  np.testing.assert_allclose(loss, trl_loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad, trl_grad, rtol=1e-5, atol=1e-8)
  if iterations > 1:  # the clip acted on some tokens, so the test covers it
    ratio = np.exp(b["log_p"] - b["old"])
    assert np.any((b["mask"] > 0) & ((ratio > 1 + eps_high) | (ratio < 0.8)))
