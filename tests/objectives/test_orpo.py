"""ORPO (use_dpo=true dpo_algo=orpo): loss, gradients and metrics equal TRL's ORPOTrainer on the same logits; the
keys as MaxText writes them; a training run on the shipped preference pairs, with LoRA, resumed = uninterrupted."""

import functools
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.config import REPO, first_devices, make_config
from support.resume import rerun_from_the_checkpoint_before_the_last

from MaxLite.cli.errors import ConfigError
from MaxLite.config import objectives
from MaxLite.objectives import orpo
from MaxLite.training.trainer import train

torch = pytest.importorskip("torch")
trl_orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")

VOCAB = 13
SEQ = 40
METRICS = (*orpo.PAIR_METRICS, "nll_loss")


def _pairs(seed: int, count: int) -> list[tuple[list[int], list[int], list[int]]]:
  rng = np.random.default_rng(seed)
  token = functools.partial(rng.integers, 1, VOCAB)
  return [
    (token(rng.integers(2, 6)).tolist(), token(rng.integers(1, 5)).tolist(), token(rng.integers(1, 6)).tolist())
    for _ in range(count)
  ]


def _trl(pairs, logits_of, lam):
  """TRL's ORPOTrainer.get_batch_loss_metrics on padded chosen/rejected batches whose "model" returns the given logits
  (a leaf tensor [2 * pairs, length, vocab]): (loss, metrics, d loss / d logits)."""
  chosen = [p + c for p, c, _ in pairs]
  rejected = [p + r for p, _, r in pairs]
  length = max(map(len, chosen + rejected))

  def padded(seqs, prompt_lens=None):
    ids = torch.zeros((len(seqs), length), dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, s in enumerate(seqs):
      ids[i, : len(s)] = torch.tensor(s)
      mask[i, : len(s)] = 1
      start = prompt_lens[i]
      labels[i, start : len(s)] = torch.tensor(s[start:])
    return ids, mask, labels

  prompts = [len(p) for p, _, _ in pairs]
  batch = {}
  for side, seqs in (("chosen", chosen), ("rejected", rejected)):
    ids, mask, labels = padded(seqs, prompts)
    batch |= {f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels}
  logits = torch.tensor(logits_of(length), requires_grad=True)
  trainer = types.SimpleNamespace(
    beta=lam,
    is_encoder_decoder=False,
    padding_value=0,
    aux_loss_enabled=False,
    accelerator=types.SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x),
  )
  cls = trl_orpo.ORPOTrainer
  trainer.concatenated_inputs = cls.concatenated_inputs
  trainer.get_batch_logps = cls.get_batch_logps
  trainer.odds_ratio_loss = functools.partial(cls.odds_ratio_loss, trainer)
  trainer.concatenated_forward = functools.partial(cls.concatenated_forward, trainer)
  model = lambda *args, **kwargs: types.SimpleNamespace(logits=logits)  # noqa: E731
  loss, metrics = cls.get_batch_loss_metrics(trainer, model, batch)
  loss.backward()
  return float(loss.detach()), metrics, logits.grad.numpy()


def _packed(pairs, rows, trl_logits):
  """The same pairs packed two to a row as MaxLite packs them (chosen = segment 2p+1, rejected 2p+2), with each
  position's logits taken from TRL's: (batch, logits [rows, SEQ, vocab], where[(row, position)] = (sequence,
  position in it))."""
  n = len(pairs)
  batch = {
    k: np.zeros((rows, SEQ), np.int32)
    for k in ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")
  }
  logits = np.zeros((rows, SEQ, VOCAB), np.float32)
  per_row = n // rows
  for i, (prompt, chosen, rejected) in enumerate(pairs):
    row, filled = divmod(i, per_row)
    at = int(np.count_nonzero(batch["inputs_segmentation"][row]))
    for side, response in ((0, chosen), (1, rejected)):
      tokens = prompt + response
      segment = 2 * filled + 1 + side
      span = slice(at, at + len(tokens) - 1)
      batch["inputs"][row, span] = tokens[:-1]
      batch["targets"][row, span] = tokens[1:]
      batch["inputs_position"][row, span] = np.arange(len(tokens) - 1)
      batch["inputs_segmentation"][row, span] = segment
      learned = np.arange(1, len(tokens)) >= len(prompt)
      batch["targets_segmentation"][row, span] = segment * learned
      logits[row, span] = trl_logits[side * n + i, : len(tokens) - 1]
      at += len(tokens) - 1
  return {k: jnp.asarray(v) for k, v in batch.items()}, logits


def _maxlite(batch, logits, lam, microbatches=1):
  """Our loss, metrics and d loss / d logits through the objective's own prepare and loss_sums (the model's forward
  pass returns `logits`), the batch split into microbatches as the train step splits it."""
  objective = objectives.registered()["orpo"]
  config = types.SimpleNamespace(orpo_lambda=lam)
  apply_fn = lambda variables, *args, **kwargs: (variables["params"], {})  # noqa: E731
  prepared = batch if objective.prepare is None else objective.prepare(batch, config)

  def total(x):
    sums = None
    for part in range(microbatches):
      rows = slice(part * x.shape[0] // microbatches, (part + 1) * x.shape[0] // microbatches)
      micro = {k: v[rows] for k, v in prepared.items()}
      _, s = objective.loss_sums(x[rows], None, apply_fn, micro, jax.random.key(0), config)
      sums = s if sums is None else jax.tree.map(jnp.add, sums, s)
    return sums["loss_sum"] / sums["count"], sums

  (loss, sums), grad = jax.value_and_grad(total, has_aux=True)(jnp.asarray(logits))
  metrics = objective.train_metrics(sums, sums["count"])
  return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


@pytest.mark.slow
@pytest.mark.parametrize("lam", [0.1, 1.5])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_loss_gradient_and_metrics_equal_trl(lam, microbatches):
  """Pairs of different prompt and response lengths, packed two to a row: the loss (mean chosen NLL over prompt and
  response tokens minus lambda * mean log sigmoid of the log odds ratio, whose two means have different
  denominators), every metric TRL logs but its padded logits means, and the gradient at every position; the same when
  the batch is split into microbatches (each sees the whole batch's token and pair counts)."""
  pairs = _pairs(0, 4)
  rng = np.random.default_rng(1)
  trl_logits = None

  def logits_of(length):
    nonlocal trl_logits
    trl_logits = (2.0 * rng.standard_normal((2 * len(pairs), length, VOCAB))).astype(np.float32)
    return trl_logits

  want_loss, want_metrics, want_grad = _trl(pairs, logits_of, lam)
  batch, logits = _packed(pairs, 2, trl_logits)
  loss, metrics, grad = _maxlite(batch, logits, lam, microbatches)
  np.testing.assert_allclose(loss, want_loss, rtol=2e-6)
  for key in METRICS:
    np.testing.assert_allclose(metrics[key], want_metrics[key], rtol=2e-5, atol=1e-6, err_msg=key)
  # Our gradient at (row, position) is TRL's at (sequence, position in it).
  _, expected = _packed(pairs, 2, want_grad)
  np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-7)
  assert np.abs(grad).max() > 1e-3


def test_a_pair_cut_to_no_response_counts_nowhere():
  """A padded-out pair slot (no tokens) and a pair whose rejected response was cut away add nothing: no NaN from
  log(1 - e^0), no NLL tokens, no pair."""
  pairs = _pairs(3, 2)
  batch, logits = _packed(pairs, 1, np.zeros((4, 16, VOCAB), np.float32))
  cut = dict(batch)
  rejected_of_second = batch["targets_segmentation"] == 4
  cut["targets_segmentation"] = jnp.where(rejected_of_second, 0, batch["targets_segmentation"])
  _, metrics, grad = _maxlite(cut, logits, 0.1)
  assert np.isfinite(grad).all() and all(np.isfinite(v) for v in metrics.values())
  assert metrics["pairs"] == 1.0
  whole_first = _maxlite(*_packed(pairs[:1], 1, np.zeros((2, 16, VOCAB), np.float32)), 0.1)[1]
  for key in METRICS:
    np.testing.assert_allclose(metrics[key], whole_first[key], rtol=1e-6, err_msg=key)


def _orpo_common(tmp_path, *extra):
  preferences = os.path.join(REPO, "assets", "post_training", "preferences-train.jsonl")
  return (
    "model_name=tiny",
    "max_target_length=64",
    "per_device_batch_size=2",
    "enable_tensorboard=false",
    f"base_output_directory={tmp_path}",
    "use_dpo=true",
    "dpo.algo=orpo",
    "dpo.orpo_lambda=0.2",
    "dataset_type=grain",
    "grain_file_type=jsonl",
    f"grain_train_files={preferences}",
    "grain_eval_files=",
    "eval_interval=-1",
    *extra,
  )


def test_maxtext_spellings_select_orpo_and_bad_values_are_one_line(tmp_path):
  config = make_config(*_orpo_common(tmp_path))
  assert (config.objective, config.dpo_algo, config.orpo_lambda) == ("orpo", "orpo", 0.2)
  yml = tmp_path / "orpo.yml"
  yml.write_text(f"base_config: {REPO}/configs/base.yml\nuse_dpo: true\ndpo:\n  algo: orpo\n  orpo_lambda: 0.3\n")
  from MaxLite.config import load_config

  nested = load_config([str(yml), "dataset_type=grain", "grain_file_type=jsonl", "grain_train_files=x.jsonl"])
  assert (nested.objective, nested.orpo_lambda) == ("orpo", 0.3)
  for extra, message in (
    (("dpo.algo=ipo",), "dpo_algo='ipo' is not one of: dpo, orpo"),
    (("dpo_beta=0.5",), "dpo_beta is DPO's; dpo_algo=orpo weighs its odds-ratio term by orpo_lambda"),
    (("dpo.orpo_lambda=0",), "orpo_lambda"),
    (("dpo.steps=3",), "dpo.steps=3 (from command line) is not a DPO key"),
    (("num_vocab_tiling=2",), "dpo_algo=orpo needs num_vocab_tiling=1"),
  ):
    with pytest.raises(ConfigError, match=re.escape(message)):
      make_config(*_orpo_common(tmp_path), *extra)


@pytest.mark.slow
@pytest.mark.parametrize(
  "lora",
  [(), ("enable_lora=true", "lora_rank=4"), ("enable_lora=true", "lora_rank=4", "lora_weight_qtype=int8")],
  ids=["full", "lora", "qlora"],
)
def test_orpo_trains_and_a_resume_equals_the_uninterrupted_run(tmp_path, lora):
  """No reference model: the loss starts at the model's NLL plus lambda * log 2 (log odds 0 at log-probabilities
  equal on both sides is not guaranteed, so only finiteness and a decrease are asserted); resumed from step 2, steps 3
  and 4 run again bit for bit; with LoRA only the adapters are trained and saved."""
  common = _orpo_common(tmp_path, "enable_checkpointing=true", "learning_rate=3e-3", *lora)
  whole = train(make_config(*common, "run_name=whole", "steps=4", "checkpoint_period=2"), first_devices(1))
  assert all(np.isfinite(r["loss"]) for r in whole)
  assert {"nll_loss", "log_odds_ratio", "rewards/accuracies"} <= set(whole[-1])
  assert whole[-1]["loss"] < whole[0]["loss"]
  # Killed after step 4, before its save, in effect: the checkpoint at 2 restarts it, and steps 3-4 run again.
  resumed = rerun_from_the_checkpoint_before_the_last(
    make_config(*common, "run_name=whole", "steps=4", "checkpoint_period=2")
  )
  assert [r["step"] for r in resumed] == [3, 4]
  assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[2:]]


@pytest.mark.slow
def test_gradient_accumulation_equals_the_whole_batch(tmp_path):
  """4 rows a step as one batch or as 2 microbatches of 2: the same losses (each microbatch's NLL is divided by the
  whole batch's tokens, its odds-ratio term by the whole batch's pairs). Rows of 256 hold different numbers of pairs
  and tokens; weighed by their own counts instead (no `prepare`) the microbatches gave 9.5958 for 9.5892 at step 1."""
  common = _orpo_common(tmp_path, "steps=3", "learning_rate=3e-3", "max_target_length=256")
  whole = train(make_config(*common, "run_name=whole", "per_device_batch_size=4"), first_devices(1))
  split = train(
    make_config(*common, "run_name=split", "per_device_batch_size=2", "gradient_accumulation_steps=2"),
    first_devices(1),
  )
  np.testing.assert_allclose([r["loss"] for r in split], [r["loss"] for r in whole], rtol=2e-6)
  np.testing.assert_allclose([r["nll_loss"] for r in split], [r["nll_loss"] for r in whole], rtol=2e-6)
