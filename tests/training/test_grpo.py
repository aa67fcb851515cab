"""GRPO end to end (use_grpo): rollouts from the KV-cache sampler, rewards from functions named in the config, the
metrics TRL logs, a resume equal to the uninterrupted run bit for bit (the sampler's keys included), a sharded mesh
equal to one device, LoRA and QLoRA under GRPO, MaxText's `rl:` spellings, and one line for each bad setting."""

from __future__ import annotations

import json
import logging
import os
import textwrap

import jax
import numpy as np
import pytest
from support.config import BASE_YML, TINY, first_devices, make_config
from support.resume import rerun_from_the_checkpoint_before_the_last

from MaxLite.checkpoint.manager import saved_arrays
from MaxLite.cli.errors import ConfigError, InputError
from MaxLite.config import load_config
from MaxLite.training.trainer import train

COMMON = (
  "use_grpo=true",
  *TINY,
  "max_prefill_predict_length=40",
  "max_decode_steps=12",
  "per_device_batch_size=8",
  "num_generations=4",
  "eval_interval=-1",
  "learning_rate=1e-2",
  "warmup_steps_fraction=0.0",
)

# A reward a random model earns unevenly: the share of digits in its completion (the shipped rewards give it 0
# everywhere, so every advantage would be 0 and no gradient would flow), and one that returns None for some rows.
REWARDS_PY = """
def digits(prompts, completions, **kwargs):
  return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def short(prompts, completions, answer, **kwargs):
  return [None if i % 3 == 0 else -len(c) / 100 for i, c in enumerate(completions)]
"""


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
  path.write_text(textwrap.dedent(REWARDS_PY))
  return str(path)


def _rewards(reward_file):
  return (f"reward_functions=['{reward_file}:digits','{reward_file}:short']", "reward_weights=[1.0,0.5]")


def _run(tmp_path, name, reward_file, *extra, devices=1):
  config = make_config(
    *COMMON,
    *_rewards(reward_file),
    f"base_output_directory={tmp_path}",
    f"run_name={name}",
    *extra,
    num_devices=devices,
  )
  return config, train(config, first_devices(devices))


def _arrays(state_dir) -> dict[str, np.ndarray]:
  """Every array a saved state holds, read as numpy (orbax without a target restores host arrays)."""
  import orbax.checkpoint as ocp

  tree = ocp.PyTreeCheckpointer().restore(str(state_dir))
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _steps(rows):
  return [r for r in rows if "loss" in r]


@pytest.mark.slow
def test_grpo_learns_logs_trl_s_metrics_and_resumes_bit_for_bit(tmp_path, reward_file):
  """Two iterations per batch and a KL penalty: the old and reference log-probabilities are both in play. Resumed
  from step 2 (as if killed after step 4, before its save), steps 3 and 4 run again as they did: same completions
  (the sampler's keys come from the step), same rewards, same losses, same final weights."""
  common = ("num_iterations=2", "grpo_beta=0.04", "checkpoint_period=2", "loss_algo=gspo-token")
  common += ("learning_rate_schedule_steps=8",)
  config, whole = _run(tmp_path, "whole", reward_file, *common, "steps=4")
  rows = _steps(whole)
  final = tmp_path / "whole" / "checkpoints" / "4"
  a = _arrays(final / "state")
  rest = rerun_from_the_checkpoint_before_the_last(config)
  for key in ("loss", "reward", "kl", "grad_norm", "completions/mean_length", "rewards/digits/mean"):
    assert [r[key] for r in rows[2:]] == [r[key] for r in _steps(rest)], key
  b = _arrays(final / "state")
  assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
  assert any("reference" in k for k in a)  # grpo_beta > 0: the frozen reference is saved with the state
  # TRL's metrics, every step: each reward's mean and std, KL, clipping, entropy, lengths, rollout speed.
  for key in (
    "rewards/digits/mean",
    "rewards/digits/std",
    "rewards/short/mean",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "kl",
    "entropy",
    "clip_ratio/region_mean",
    "completions/mean_length",
    "completions/clipped_ratio",
    "rollout_tokens_per_sec",
  ):
    assert all(np.isfinite(r[key]) for r in rows), key
  assert 0.0 < rows[0]["kl"]  # its second iteration's policy has moved from the reference
  assert any(r["grad_norm"] > 0 for r in rows)  # rewards vary within groups, so the policy gradient flows
  logged = [json.loads(line) for line in open(tmp_path / "whole" / "metrics.jsonl")]
  assert [r["reward"] for r in logged if "reward" in r] == [r["reward"] for r in rows]


@pytest.mark.slow
def test_grpo_on_a_sharded_mesh_equals_one_device(tmp_path, reward_file):
  """The same completions sampled on 8 devices (data x fsdp x tensor) as on one, the same rewards, losses and
  updated weights. One step: the next one samples from weights that differ by roundings, and a sampled token may
  flip on any such difference. A large adam_eps: Adam's first update is lr * sign(gradient), and a gradient that is
  0 but for roundings (advantages cancel within a group) would get a full step of either sign."""
  extra = ("steps=1", "grpo_beta=0.04", "num_iterations=2", "adam_eps=1e-4")
  _, one = _run(tmp_path, "one", reward_file, *extra)
  _, many = _run(
    tmp_path,
    "many",
    reward_file,
    *extra,
    "per_device_batch_size=1",
    "ici_data_parallelism=2",
    "ici_fsdp_parallelism=2",
    "ici_tensor_parallelism=2",
    devices=8,
  )
  one, many = _steps(one)[0], _steps(many)[0]
  for key in ("reward", "completions/mean_length", "rewards/digits/mean"):
    assert one[key] == many[key], key
  for key in ("loss", "kl", "grad_norm", "entropy"):
    np.testing.assert_allclose(one[key], many[key], rtol=2e-4, atol=1e-6, err_msg=key)
  a = _arrays(tmp_path / "one" / "checkpoints" / "1" / "state")
  b = _arrays(tmp_path / "many" / "checkpoints" / "1" / "state")
  for k in a:
    np.testing.assert_allclose(a[k].astype(np.float32), b[k].astype(np.float32), rtol=1e-3, atol=1e-5, err_msg=k)


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
  out = tmp_path_factory.mktemp("base")
  config = make_config(
    "model_name=tiny",
    "max_target_length=64",
    "dataset_type=synthetic",
    "steps=1",
    "enable_tensorboard=false",
    f"base_output_directory={out}",
    "run_name=pre",
  )
  train(config, first_devices(1))
  return str(out / "pre" / "checkpoints" / "1")


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["", "int8"])
def test_lora_and_qlora_train_under_grpo_and_resume_bit_for_bit(tmp_path, reward_file, base_checkpoint, qtype):
  """The adapters alone change; the reference is the base with the adapters off (no second copy)."""
  lora = ("enable_lora=true", "lora_rank=4", "lora_alpha=8", f"lora_weight_qtype={qtype}", "grpo_beta=0.04")
  extra = (*lora, f"load_parameters_path={base_checkpoint}", "checkpoint_period=1", "learning_rate_schedule_steps=2")
  config, whole = _run(tmp_path, "whole", reward_file, *extra, "steps=2")
  rest = rerun_from_the_checkpoint_before_the_last(config)  # step 2 again, from step 1's checkpoint
  assert _steps(whole)[-1]["loss"] == _steps(rest)[-1]["loss"]
  # One iteration per batch: the first step's policy is its reference (the base with the adapters at zero).
  assert _steps(whole)[0]["kl"] == 0.0 and any(r["grad_norm"] > 0 for r in _steps(whole))
  saved = saved_arrays(str(tmp_path / "whole" / "checkpoints" / "2" / "state"))
  assert saved and all("lora" in k for k in saved if "params" in k)


@pytest.mark.slow
def test_no_reward_spread_updates_nothing_and_says_why(tmp_path, base_checkpoint, monkeypatch, caplog):
  """The shipped rewards on a model that has not learnt the task: every reward 0, every advantage 0. No update at
  all (Adam turned the KL term's rounding-sized gradient into full steps, and kl climbed to 1.09 by step 4), and a
  warning naming the cause and the fix once it has lasted FLAT_STEPS_WARNING steps."""
  from MaxLite.training import grpo_run

  monkeypatch.setattr(grpo_run, "FLAT_STEPS_WARNING", 2, raising=False)
  config = make_config(
    *COMMON,
    f"load_parameters_path={base_checkpoint}",
    "grpo_beta=0.04",
    "steps=3",
    "checkpoint_period=3",
    f"base_output_directory={tmp_path}",
    "run_name=flat",
  )
  with caplog.at_level(logging.WARNING):
    rows = _steps(train(config, first_devices(1)))
  assert [r["frac_reward_zero_std"] for r in rows] == [1.0, 1.0, 1.0] and [r["reward"] for r in rows] == [0.0] * 3
  assert all(r["kl"] < 1e-6 for r in rows), [r["kl"] for r in rows]  # the policy stays its reference
  before = _arrays(base_checkpoint + "/state")
  after = _arrays(tmp_path / "flat" / "checkpoints" / "3" / "state")
  params = [k for k in after if k.startswith("['params']")]
  assert params and all(np.array_equal(after[k], before[k]) for k in params)
  moments = [k for k in after if k.startswith("['opt_state']")]
  assert moments and all(not np.any(after[k]) for k in moments)  # the fresh optimizer's zeros, its count included
  assert int(after["['step']"]) == 0
  warned = [r.getMessage() for r in caplog.records if "GRPO steps 1-2" in r.getMessage()]
  assert len(warned) == 1 and "load_parameters_path" in warned[0] and "SFT" in warned[0], caplog.text


def test_maxtext_rl_spellings_set_the_same_keys(tmp_path):
  yml = tmp_path / "rl.yml"
  yml.write_text(
    f"base_config: {BASE_YML}\nuse_grpo: true\nrl:\n  num_generations: 4\n  grpo_beta: 0.0\n"
    "  loss_algo: gspo-token\n  epsilon_high: null\n  loss_agg_mode: token-mean\n"
  )
  config = load_config([str(yml), "rl.num_iterations=2", "per_device_batch_size=4"], num_devices=1)
  assert (config.num_generations, config.grpo_beta, config.loss_algo, config.num_iterations) == (
    4,
    0.0,
    "gspo-token",
    2,
  )
  assert config.epsilon_high == -1.0 and config.loss_agg_mode == "token-mean"
  # No data named: the shipped problems and their answers; a GRPO step makes num_iterations updates.
  assert config.grain_train_files.endswith("arithmetic-train.jsonl") and config.train_data_columns == (
    "prompt",
    "answer",
  )
  assert config.learning_rate_schedule_steps == 2 * config.steps


@pytest.mark.parametrize(
  "overrides,fragment",
  [
    (("num_generations=1",), "num_generations must be at least 2"),
    (("per_device_batch_size=6", "num_generations=4"), "not a multiple of num_generations=4"),
    (("reward_weights=[1.0]",), "reward_weights has 1 weights for 2 reward_functions"),
    (("grpo_epsilon=1.5",), "grpo_epsilon must be in (0, 1)"),
    (("loss_agg_mode=seq-mean",), "loss_agg_mode"),
    (("use_sft=true",), "choose one"),
    (("max_prefill_predict_length=60", "max_decode_steps=12", "max_target_length=64"), "exceeds max_target_length"),
    (("rl.use_agentic_rollout=true",), "MaxText key that MaxLite does not implement"),
    (("ensemble_size=2",), "GRPO is not supported for ensembles"),
    (("grain_train_files=my_prompts.jsonl", "grain_file_type=jsonl"), "needs reward_functions"),
    (("rollout_temperature=0",), "rollout_temperature must be in (0, inf)"),
    (("rl.rollout_temperature=-1",), "rollout_temperature must be in (0, inf)"),
    (("rollout_top_k=-1",), "rollout_top_k must be >= 0"),
    (("rollout_top_p=1.5",), "rollout_top_p must be in (0, 1]"),
    # decode.py's keys (MaxText's rl.yml sets them for its rollouts): named, with GRPO's own
    (("decode_sampling_temperature=-1",), "samples its rollouts with rollout_temperature"),
    (("decode_sampling_top_k=40",), "write rollout_top_k=40"),
    (("decode_sampling_nucleus_p=0.9",), "write rollout_top_p=0.9"),
  ],
)
def test_bad_grpo_settings_are_one_line(overrides, fragment):
  with pytest.raises(ConfigError) as e:
    load_config([BASE_YML, "use_grpo=true", "per_device_batch_size=4", *overrides], num_devices=1)
  assert fragment in str(e.value) and "\n" not in str(e.value)


def test_a_reward_that_does_not_import_and_a_prompt_longer_than_the_cache_are_one_line(tmp_path):
  common = (*COMMON, f"base_output_directory={tmp_path}", "steps=1", "enable_checkpointing=false")
  with pytest.raises(ConfigError) as e:
    train(make_config(*common, "reward_functions=['no_such_module:score']"), first_devices(1))
  assert "no_such_module:score" in str(e.value) and "\n" not in str(e.value)
  assert not os.listdir(tmp_path)  # refused before a run directory was made
  with pytest.raises(InputError) as e:
    train(make_config(*common, "max_prefill_predict_length=8"), first_devices(1))
  assert "longer than max_prefill_predict_length=8" in str(e.value) and "\n" not in str(e.value)


def test_train_compile_lowers_the_grpo_update_step():
  """AOT compilation (train_compile.py) gets the GRPO batch: the token arrays, the advantages, the sampling policy's
  and the reference's log-probabilities."""
  from MaxLite.aot.compile_step import lower_train_step

  config = make_config(*COMMON, "num_iterations=2", "grpo_beta=0.04")
  lowered, _ = lower_train_step(config, first_devices(1))
  assert "old_log_probs" in str(lowered.args_info) and "ref_log_probs" in str(lowered.args_info)
