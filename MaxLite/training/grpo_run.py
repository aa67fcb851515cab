"""One GRPO step, on the training mesh: sample num_generations completions of each prompt with the policy (the
KV-cache sampler, models/sampling.py), score them with the reward functions, turn the scores into group-relative
advantages, and make num_iterations updates on that batch (the loss is objectives/grpo.py's, inside the jitted train
step). Evaluation decodes held-out prompts greedily and reports the mean reward of each function.

A step's randomness is fold_in(seed, step): the same step samples the same completions, so a resumed run equals
the uninterrupted one bit for bit. The prompt stream's position is what checkpoints save (data/prompts.py).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec

from MaxLite import storage
from MaxLite.cli.errors import InputError
from MaxLite.config import Config
from MaxLite.data.chat import ChatTemplate
from MaxLite.data.prompts import PromptRecords
from MaxLite.data.tokenizer import continuation_text, load_tokenizer
from MaxLite.models import build, sampling
from MaxLite.objectives import grpo
from MaxLite.parallel import sharding as sharding_lib
from MaxLite.training import rewards
from MaxLite.training.evaluation import eval_due
from MaxLite.training.metrics import StepLog
from MaxLite.training.train_state import model_params

# The rollout's stream of random numbers: fold_in(fold_in(seed, step), ROLLOUT_STREAM), apart from the step's dropout.
ROLLOUT_STREAM = 1
# After this many steps in a row in which no group's rewards differed (so nothing was updated), the run says why.
FLAT_STEPS_WARNING = 5


def _rows_sharding(mesh: jax.sharding.Mesh, config: Config, rank: int) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec(tuple(config.batch_mesh_axes), *([None] * (rank - 1))))


def _place(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A host array every process holds whole, as a global array: each device takes its own slice (multi-process too)."""
  return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


class Prompter:
  """Prompt text -> the ids the model reads: BOS + the prompt, or with use_chat_template a user turn with the
  assistant's turn opened (what SFT trained on either way)."""

  def __init__(self, config: Config, what: str):
    self.tokenizer = load_tokenizer(storage.resolve(config.tokenizer_path), config.tokenizer_type)
    self._template = (
      ChatTemplate.load(storage.resolve(config.tokenizer_path), config.chat_template_path)
      if config.use_chat_template
      else None
    )
    bos = self.tokenizer.bos_id
    self._head = [bos] if config.add_bos and bos >= 0 and self._template is None else []
    self._limit, self._what = config.max_prefill_predict_length, what

  def ids(self, prompt: str, index: int) -> list[int]:
    if self._template is not None:
      ids = self.tokenizer.encode(
        self._template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
      )
    else:
      ids = self._head + self.tokenizer.encode(prompt)
    if len(ids) > self._limit:
      raise InputError(
        f"{self._what} record {index}: its prompt is {len(ids)} tokens, longer than max_prefill_predict_length="
        f"{self._limit} (raise it, keeping max_prefill_predict_length + max_decode_steps <= max_target_length)"
      )
    return ids


def completion_lengths(completions: np.ndarray, eos_id: int) -> np.ndarray:
  """Each sampled row's length [rows]: up to and including its first end-of-sequence token, else all of it."""
  ended = completions == eos_id if eos_id >= 0 else np.zeros(completions.shape, bool)
  return np.where(ended.any(axis=1), ended.argmax(axis=1) + 1, completions.shape[1]).astype(np.int32)


def training_rows(prompts: list[list[int]], completions: np.ndarray, eos_id: int, length: int) -> dict[str, np.ndarray]:
  """The train step's batch [rows, length] from each row's prompt ids and sampled tokens [rows, steps]: the prompt
  then the completion up to and including its end-of-sequence token, targets_segmentation 1 on the positions whose
  target is a completion token. Also "completion_lengths" [rows]."""
  rows = len(prompts)
  batch = {k: np.zeros((rows, length), np.int32) for k in ("inputs", "targets", "inputs_segmentation")}
  batch["targets_segmentation"] = np.zeros((rows, length), np.int32)
  batch["inputs_position"] = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy()
  lengths = completion_lengths(completions, eos_id)
  for r, (prompt, sampled, n) in enumerate(zip(prompts, completions, lengths)):
    sequence = np.concatenate([np.asarray(prompt, np.int32), sampled[:n]])
    batch["inputs"][r, : len(sequence)] = sequence
    batch["inputs_segmentation"][r, : len(sequence)] = 1
    batch["targets"][r, : len(sequence) - 1] = sequence[1:]
    batch["targets_segmentation"][r, len(prompt) - 1 : len(prompt) - 1 + n] = 1
  batch["completion_lengths"] = lengths
  return batch


class GrpoSteps:
  """The loop's step for use_grpo: `(state, step) -> (state, metrics)`. `batches` is the prompt stream a checkpoint
  saves with the step."""

  def __init__(self, config: Config, mesh: jax.sharding.Mesh, pieces: Any):
    self._config, self._mesh, self._pieces = config, mesh, pieces
    self._prompter = Prompter(config, "grain_train_files")
    self.tokenizer = self._prompter.tokenizer
    self._functions, self._names, self._weights = reward_setup(config)
    self._rows = config.global_batch_size_to_train_on
    self.batches = PromptRecords(config, "train", self._rows // config.num_generations)
    param_shardings = model_params(pieces.device_shardings)
    self._row_shardings = (_rows_sharding(mesh, config, 2), _rows_sharding(mesh, config, 1))
    replicated = sharding_lib.replicated(mesh)
    self._rollout = rollout_function(config, self.tokenizer.eos_id, param_shardings, self._row_shardings, replicated)
    self._flat_since: int | None = None  # the first of the latest steps in a row whose advantages were all 0
    self._score = jax.jit(
      lambda params, reference, batch: grpo_scores(config, params, reference, batch),
      in_shardings=(param_shardings, _reference_shardings(pieces.device_shardings), pieces.batch_sharding),
      out_shardings=pieces.batch_sharding,
    )

  def _watch_reward_spread(self, step: int, advantages: np.ndarray, scores: np.ndarray) -> None:
    """Warns once FLAT_STEPS_WARNING steps in a row had no reward spread in any group (objectives/grpo.py: no
    update)."""
    if np.any(advantages):
      self._flat_since = None
      return
    self._flat_since = step if self._flat_since is None else self._flat_since
    if step - self._flat_since + 1 == FLAT_STEPS_WARNING:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no completion scored: the mean is NaN
        reward = float(np.nanmean(grpo.scored_totals(scores, self._weights)))
      logging.warning(_flat_message(self._flat_since, step, reward))

  def __call__(self, state: Any, step: int) -> tuple[Any, dict[str, Any]]:
    config, g = self._config, self._config.num_generations
    records = next(self.batches)
    prompt_ids = [self._prompter.ids(r[self.batches.prompt_column], r["_index"]) for r in records]
    prompt_ids = [ids for ids in prompt_ids for _ in range(g)]  # each prompt's group, adjacent
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), step), ROLLOUT_STREAM)
    started = time.perf_counter()
    completions = sample(self._rollout, model_params(state), prompt_ids, rng, config, self._row_shardings)
    rollout_seconds = time.perf_counter() - started
    rows = training_rows(prompt_ids, completions, self.tokenizer.eos_id, config.max_target_length)
    lengths = rows.pop("completion_lengths")
    texts = completion_texts(self.tokenizer, prompt_ids, completions, lengths)
    prompts = [r[self.batches.prompt_column] for r in records for _ in range(g)]
    columns = {c: [r[c] for r in records for _ in range(g)] for c in records[0] if c not in ("_index",)}
    columns.pop(self.batches.prompt_column)
    scores = rewards.score(self._functions, prompts, texts, columns)
    advantages = grpo.group_advantages(scores, self._weights, g)
    self._watch_reward_spread(step, advantages, scores)
    rows["advantages"] = np.repeat(advantages[:, None], config.max_target_length, axis=1)
    batch = {k: _place(v, self._pieces.batch_sharding) for k, v in rows.items()}
    reference = state.frozen if state.frozen is not None else state.reference
    batch = self._score(model_params(state), reference, batch)
    per_iteration = []
    for _ in range(config.num_iterations):
      state, metrics = self._pieces.step(state, batch)
      per_iteration.append(metrics)
    metrics = jax.tree.map(lambda *values: sum(values) / len(values), *per_iteration)
    return state, metrics | reward_metrics(self._names, scores, self._weights, g) | {
      "completions/mean_length": float(np.mean(lengths)),
      "completions/clipped_ratio": float(np.mean(lengths == config.max_decode_steps)),
      "rollout_tokens_per_sec": float(np.sum(lengths) / max(rollout_seconds, 1e-9)),
    }


def _flat_message(first: int, step: int, reward: float) -> str:
  return (
    f"GRPO steps {first}-{step}: in every group all completions got the same reward (mean reward {reward:.3f}), so "
    "every advantage is 0 and the policy was not updated: a model that never (or always) "
    "earns the reward has nothing to compare. Start from a model that sometimes does, e.g. load_parameters_path= the "
    "checkpoints of an SFT run on the task (the README's GRPO walkthrough), or add a reward for partial success"
  )


def reward_setup(config: Config) -> tuple[list[Any], list[str], list[float]]:
  """The reward functions the config names, their metric names and their weights (1.0 each by default)."""
  functions = rewards.load(config.reward_functions)
  return functions, rewards.names(config.reward_functions), list(config.reward_weights) or [1.0] * len(functions)


def rollout_function(config: Config, eos_id: int, param_shardings: Any, rows: tuple, out: Any, greedy: bool = False):
  """The jitted sampler with the config's length and rollout_temperature/top_k/top_p, on the training mesh."""
  rollout = sampling.make_rollout(
    build.model(config, decode=True),
    steps=config.max_decode_steps,
    eos_id=eos_id,
    temperature=config.rollout_temperature,
    top_k=config.rollout_top_k,
    top_p=config.rollout_top_p,
    greedy=greedy,
    in_shardings=(param_shardings, rows[0], rows[1], None),
    out_shardings=out,
  )
  return sharding_lib.traced_under(sharding_lib.decode_axis_rules(config), rollout)


def sample(rollout: Any, params: Any, prompt_ids: list[list[int]], rng: Any, config: Config, rows: tuple) -> np.ndarray:
  """Sampled tokens [rows, max_decode_steps] of every prompt, on the host."""
  ids = np.zeros((len(prompt_ids), config.max_prefill_predict_length), np.int32)
  for r, prompt in enumerate(prompt_ids):
    ids[r, : len(prompt)] = prompt
  lengths = np.asarray([len(p) for p in prompt_ids], np.int32)
  return np.asarray(rollout(params, _place(ids, rows[0]), _place(lengths, rows[1]), rng))


def completion_texts(
  tokenizer: Any, prompts: list[list[int]], completions: np.ndarray, lengths: np.ndarray
) -> list[str]:
  """Each completion's text, without its end-of-sequence token: what the reward functions read."""
  eos = tokenizer.eos_id
  texts = []
  for prompt, sampled, n in zip(prompts, completions, lengths):
    new = [int(t) for t in sampled[:n] if t != eos and t < tokenizer.vocab_size]
    texts.append(continuation_text(tokenizer, prompt, new))
  return texts


def reward_metrics(names: list[str], scores: np.ndarray, weights: list[float], g: int) -> dict[str, float]:
  """TRL's reward metrics (GRPOTrainer._generate_and_score_completions): each function's mean and std over the
  completions it scored; `reward`, the mean of the weighted sum of the functions over the completions any function
  scored (nanmean), `reward_std` its standard deviation over the batch (TRL's nanstd: unbiased, NaN for fewer than
  two), and `frac_reward_zero_std` the fraction of groups whose (two or more) scored rewards are all equal: their
  advantages are 0, they teach nothing."""
  out = {}
  for name, column in zip(names, scores.T):
    scored = column[~np.isnan(column)]
    out[f"rewards/{name}/mean"] = float(np.mean(scored)) if len(scored) else float("nan")
    out[f"rewards/{name}/std"] = float(np.std(scored, ddof=1)) if len(scored) > 1 else 0.0
  total = grpo.scored_totals(scores, weights)
  with warnings.catch_warnings():  # nothing (or one completion) scored: NaN, as TRL's
    warnings.simplefilter("ignore", RuntimeWarning)
    group_std = _nanstd(total.reshape(-1, g), axis=1)
    return out | {
      "reward": float(np.nanmean(total)),
      "reward_std": float(_nanstd(total)),
      "frac_reward_zero_std": float(np.mean(np.isclose(group_std, 0.0))),
    }


def _nanstd(values: np.ndarray, axis: int | None = None) -> np.ndarray:
  """TRL's nanstd: the unbiased standard deviation of the non-NaN values, NaN where there are fewer than two."""
  count = np.sum(~np.isnan(values), axis=axis)
  std = np.nanstd(values, axis=axis, ddof=1)
  return np.where(count > 1, std, np.nan)


def _reference_shardings(shardings: Any) -> Any:
  """Where the reference lives: LoRA's frozen base, or the state's own reference (None when grpo_beta is 0)."""
  return shardings.frozen if shardings.frozen is not None else shardings.reference


def grpo_scores(config: Config, params: Any, reference: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The batch with the log-probabilities the loss holds fixed over a step's iterations: the sampling policy's
  ("old_log_probs", with num_iterations > 1) and the reference's ("ref_log_probs", with grpo_beta > 0). Both are
  deterministic forward passes (no dropout), as TRL's are."""
  batch = dict(batch)
  if config.num_iterations > 1:
    batch["old_log_probs"] = _log_probs(build.model(config), params, batch, config)
  if config.grpo_beta > 0:
    batch["ref_log_probs"] = _log_probs(build.model(config, adapters=False), reference, batch, config)
  return batch


def _log_probs(model: Any, params: Any, batch: dict[str, jax.Array], config: Config) -> jax.Array:
  logits = model.apply(
    {"params": jax.lax.stop_gradient(params)}, batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"]
  )
  return grpo.completion_log_probs(logits, batch["targets"], config)


class GrpoEvaluator:
  """Every eval_interval steps (and before the first step of a fresh run): greedy completions of the first
  eval_steps batches of eval prompts, and each reward function's mean over them."""

  def __init__(self, config: Config, mesh: jax.sharding.Mesh, pieces: Any):
    self._config = config
    self._prompter = Prompter(config, "grain_eval_files")
    self._functions, self._names, self._weights = reward_setup(config)
    self._rows = (_rows_sharding(mesh, config, 2), _rows_sharding(mesh, config, 1))
    self._batches = PromptRecords(config, "eval", config.global_batch_size_to_train_on)
    shardings = model_params(pieces.device_shardings)
    replicated = sharding_lib.replicated(mesh)
    eos = self._prompter.tokenizer.eos_id
    self._rollout = rollout_function(config, eos, shardings, self._rows, replicated, greedy=True)

  def evaluate(self, params: Any) -> dict[str, float]:
    self._batches.rewind()
    all_scores = []
    for _ in range(self._config.eval_steps):
      records = next(self._batches)
      prompt_ids = [self._prompter.ids(r[self._batches.prompt_column], r["_index"]) for r in records]
      completions = sample(self._rollout, params, prompt_ids, jax.random.key(0), self._config, self._rows)
      lengths = completion_lengths(completions, self._prompter.tokenizer.eos_id)
      texts = completion_texts(self._prompter.tokenizer, prompt_ids, completions, lengths)
      columns = {c: [r[c] for r in records] for c in records[0] if c not in ("_index", self._batches.prompt_column)}
      prompts = [r[self._batches.prompt_column] for r in records]
      all_scores.append(rewards.score(self._functions, prompts, texts, columns))
    scores = np.concatenate(all_scores)
    with np.errstate(invalid="ignore"):
      means = {f"eval_rewards/{n}/mean": float(np.nanmean(col)) for n, col in zip(self._names, scores.T)}
    total = grpo.weighted_total(scores, self._weights)
    return means | {"eval_reward": float(np.mean(total))}

  def maybe_eval(self, step: int, state: Any, log: StepLog) -> None:
    if not eval_due(self._config, step):
      return
    log.flush()
    log.record_eval(step, self.evaluate(model_params(state)))

  def __enter__(self) -> GrpoEvaluator:
    return self

  def __exit__(self, *exc: object) -> None:
    pass


def make_evaluator(config: Config, mesh: jax.sharding.Mesh, pieces: Any) -> Any:
  if config.eval_interval > 0 and config.grain_eval_files:
    return GrpoEvaluator(config, mesh, pieces)
  logging.info("GRPO: no evaluation (eval_interval <= 0 or no grain_eval_files)")
  return None
