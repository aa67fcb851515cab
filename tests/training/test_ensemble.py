"""Ensembles (ensemble_size): each member trains exactly as a separate run with its seeds and learning rate, on one
device and sharded over eight; resume is bit for bit; distinct data; per-member metrics; one member decodes and exports;
bad keys are one line."""

import json
import os

import flax.linen as nn
import numpy as np
import pytest
from support.config import TINY, first_devices, make_config, run_train_cli
from support.resume import rerun_from_the_checkpoint_before_the_last

from MaxLite.cli.errors import ConfigError
from MaxLite.training.trainer import train

RUN = (
  *TINY,
  "dataset_type=synthetic",
  "warmup_steps_fraction=0.0",
  "enable_checkpointing=false",
  "steps=3",
  "eval_interval=-1",  # no eval: the tests that evaluate ask for it
)


def _train(tmp_path, name, *overrides, num_devices=1):
  where = (f"base_output_directory={tmp_path}", f"run_name={name}")
  config = make_config(*RUN, *where, *overrides, num_devices=num_devices)
  return train(config, first_devices(num_devices))


def _series(rows, key):
  return [r[key] for r in rows if key in r]


@pytest.mark.slow
def test_members_equal_separate_runs_on_one_device(tmp_path):
  """Two members differing by seed (the default): member i's losses and grad norms are those of a run with
  init_weights_seed=i and seed=i, with warm-up, two accumulated microbatches, dropout and a clipping threshold the
  gradients exceed (each member's own); the members do differ."""
  each = (
    "per_device_batch_size=2",
    "warmup_steps_fraction=0.5",
    "gradient_accumulation_steps=2",
    "dropout_rate=0.1",
    "gradient_clipping_threshold=0.5",
  )
  rows = _train(tmp_path, "ensemble", "ensemble_size=2", *each)
  assert min(_series(rows, "grad_norm/member_1")) > 0.5  # clipped every step
  for i in range(2):
    alone = _train(tmp_path, f"alone{i}", f"init_weights_seed={i}", f"seed={i}", *each)
    np.testing.assert_allclose(_series(rows, f"loss/member_{i}"), _series(alone, "loss"), rtol=1e-5)
    np.testing.assert_allclose(_series(rows, f"grad_norm/member_{i}"), _series(alone, "grad_norm"), rtol=1e-5)
  assert abs(rows[0]["loss/member_0"] - rows[0]["loss/member_1"]) > 1e-3
  np.testing.assert_allclose(_series(rows, "loss"), np.mean([_series(rows, f"loss/member_{i}") for i in range(2)], 0))


@pytest.mark.slow
def test_learning_rate_sweep_sharded_over_eight_devices(tmp_path):
  """Four members with their own peak rates, the ensemble axis 4 x fsdp 2 on eight devices: members 0 and 3 equal
  separate two-device fsdp runs at those rates (same seeds), and their parameters really are split over the ensemble
  axis (one device holds one member's share)."""
  rates = [1e-3, 3e-3, 1e-2, 3e-2]
  rows = _train(
    tmp_path,
    "sweep",
    f"ensemble_learning_rates={rates}",
    "ensemble_size=4",
    "ici_ensemble_parallelism=4",
    "per_device_batch_size=2",
    num_devices=8,
  )
  for i in (0, 3):
    alone = _train(tmp_path, f"rate{i}", f"learning_rate={rates[i]}", "per_device_batch_size=2", num_devices=2)
    np.testing.assert_allclose(_series(rows, f"loss/member_{i}"), _series(alone, "loss"), rtol=1e-5)
    np.testing.assert_allclose(_series(rows, f"learning_rate/member_{i}"), _series(alone, "learning_rate"), rtol=1e-6)
    np.testing.assert_allclose(_series(rows, f"grad_norm/member_{i}"), _series(alone, "grad_norm"), rtol=1e-5)
  # Same seeds, same data: the first step's loss is the same model on the same batch for every member.
  np.testing.assert_allclose([rows[0][f"loss/member_{i}"] for i in range(4)], rows[0]["loss/member_0"], rtol=1e-6)
  assert rows[-1]["loss/member_3"] != pytest.approx(rows[-1]["loss/member_0"], rel=1e-3)


def test_ensemble_state_is_sharded_over_the_ensemble_axis():
  import jax
  from flax.linen import partitioning as nn_partitioning

  from MaxLite.parallel import sharding
  from MaxLite.parallel.mesh import create_mesh
  from MaxLite.training import builder

  config = make_config(*RUN, "ensemble_size=8", "ici_ensemble_parallelism=4", num_devices=8)
  mesh = create_mesh(config, first_devices(8))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding.axis_rules(config)):
    pieces = builder.training(config, mesh)
  embedding = pieces.abstract.params["token_embedder"]["embedding"]
  placed = pieces.shardings.params["token_embedder"]["embedding"]
  assert embedding.shape[0] == 8
  assert placed.shard_shape(embedding.shape)[0] == 2  # 8 members over 4 devices
  assert placed.shard_shape(embedding.shape)[1:] != embedding.shape[1:]  # and each member split over fsdp=2
  assert pieces.abstract.step.shape == ()  # one step counter


@pytest.mark.slow
def test_a_diverging_member_keeps_its_weights_while_the_others_train(tmp_path):
  """A sweep with an absurd rate: that member's loss turns NaN, the run still finishes and saves a finite checkpoint,
  and the sane member trains exactly as it does beside a sane partner."""
  common = ("ensemble_size=2", "per_device_batch_size=2", "steps=4", "enable_checkpointing=true")
  rows = _train(tmp_path, "wild", *common, "ensemble_learning_rates=[3.0e-3,1.0e30]")
  sane = _train(tmp_path, "sane", *common, "ensemble_learning_rates=[3.0e-3,1.0e-3]")
  wild = _series(rows, "loss/member_1")
  assert np.isfinite(wild[0]) and np.isnan(wild[-1])
  assert _series(rows, "loss/member_0") == _series(sane, "loss/member_0")
  # The logged loss is the mean over the members still training: member 0's alone once member 1 has diverged.
  stopped = [r for r in rows if "loss" in r and np.isnan(r["loss/member_1"])]
  assert stopped and all(r["loss"] == pytest.approx(r["loss/member_0"], rel=1e-6) for r in stopped)
  assert os.path.isdir(tmp_path / "wild" / "checkpoints" / "4")


@pytest.mark.slow
def test_distinct_data_gives_each_member_its_own_batches(tmp_path):
  """Identical members (equal rates, so equal seeds): on the same batches their losses are bit-identical (and the
  ensemble's eval loss is theirs), on distinct ones they differ."""
  common = ("ensemble_size=2", "ensemble_learning_rates=[3e-3,3e-3]", "per_device_batch_size=2", "steps=2")
  same = _train(tmp_path, "same", *common, "eval_interval=2", "eval_steps=1")
  distinct = _train(tmp_path, "distinct", *common, "ensemble_data=distinct")
  assert same[0]["loss/member_0"] == same[0]["loss/member_1"]
  # Two identical models averaged are that model: the ensemble's eval loss is each member's.
  assert same[-1]["eval_ensemble_loss"] == pytest.approx(same[-1]["eval_loss/member_0"], rel=1e-6)
  assert distinct[0]["loss/member_0"] != distinct[0]["loss/member_1"]


@pytest.mark.slow
def test_resume_is_bit_identical_and_metrics_name_members(tmp_path):
  """Resumed from step 3, steps 4-6 run again with the uninterrupted run's losses, every member bit for bit;
  metrics.jsonl and the eval rows carry one series per member and the ensemble's averaged-probability eval loss."""
  common = (
    "ensemble_size=2",
    "enable_checkpointing=true",
    "checkpoint_period=3",
    "learning_rate_schedule_steps=6",
    "eval_interval=3",
    "eval_steps=1",
    "per_device_batch_size=2",
  )
  whole = _train(tmp_path, "whole", *common, "steps=6")
  where = (f"base_output_directory={tmp_path}", "run_name=whole")
  resumed = rerun_from_the_checkpoint_before_the_last(make_config(*RUN, *where, *common, "steps=6"))
  keys = ("loss/member_0", "loss/member_1", "grad_norm/member_1")
  assert [[r[k] for k in keys] for r in whole if r["step"] > 3 and "loss" in r] == [
    [r[k] for k in keys] for r in resumed if "loss" in r
  ]
  assert _series(whole, "eval_loss/member_1")[-1] == _series(resumed, "eval_loss/member_1")[-1]
  with open(os.path.join(tmp_path, "whole", "metrics.jsonl")) as f:
    evals = [row for row in map(json.loads, f) if "eval_loss" in row]
  last = evals[-1]
  members = [last["eval_loss/member_0"], last["eval_loss/member_1"]]
  assert last["eval_loss"] == pytest.approx(np.mean(members))
  # Averaging two different models' probabilities beats their average loss (Jensen's inequality, strict here).
  assert last["eval_ensemble_loss"] < np.mean(members) - 1e-3


@pytest.mark.slow
def test_one_member_decodes_and_exports(tmp_path):
  """decode.py and to_hf read ensemble_member's parameters out of an ensemble step: decode's greedy text for member 1
  equals a lone run's (same seeds), and member 0's differs; without ensemble_member it is one error line."""
  import subprocess
  import sys

  from support.config import FAST_COMPILE, REPO

  _train(tmp_path, "ens", "ensemble_size=2", "enable_checkpointing=true", "per_device_batch_size=2")
  _train(tmp_path, "alone", "init_weights_seed=1", "seed=1", "enable_checkpointing=true", "per_device_batch_size=2")

  def decode(path, *extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
    command = [sys.executable, "MaxLite/decode.py", "configs/base.yml", f"load_parameters_path={path}", *extra]
    command += ["prompt=The", "max_prefill_predict_length=8", "max_decode_steps=6", "model_name=tiny"]
    command += ["max_target_length=64"]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

  member1 = decode(tmp_path / "ens/checkpoints/3", "ensemble_member=1")
  alone = decode(tmp_path / "alone/checkpoints/3")
  assert member1.returncode == 0, member1.stderr[-2000:]
  assert member1.stdout == alone.stdout
  assert decode(tmp_path / "ens/checkpoints/3", "ensemble_member=0").stdout != alone.stdout
  missing = decode(tmp_path / "ens/checkpoints/3")
  assert missing.returncode == 2
  assert missing.stderr.strip().splitlines()[-1] == (
    f"error: {tmp_path}/ens/checkpoints/3 holds an ensemble of 2 members: choose one with ensemble_member=0..1 (got -1)"
  )
  # The Hugging Face export of member 1 holds the lone run's weights (trained in another program: to 1e-5).
  from safetensors.numpy import load_file

  from MaxLite.checkpoint import hf

  def exported(step_dir, name, *extra):
    files = hf.to_hf(str(step_dir), str(tmp_path / name), list(extra))
    return {k: v for f in files if f.endswith(".safetensors") for k, v in load_file(str(tmp_path / name / f)).items()}

  lone, member = (
    exported(tmp_path / "alone/checkpoints/3", "hf-alone"),
    exported(tmp_path / "ens/checkpoints/3", "hf-member", "ensemble_member=1"),
  )
  assert lone.keys() == member.keys()
  for name in lone:
    np.testing.assert_allclose(member[name], lone[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_ensemble_eval_loss_is_that_of_the_averaged_probabilities():
  """eval_ensemble_loss against numpy: per real token, log of the mean over K=3 members of each member's probability
  of the target (members scaled apart so the mean of probabilities is far from the mean of log-probabilities), masked
  mean over a batch with padding and two documents in a row; the per-member losses too."""
  import jax
  import jax.numpy as jnp
  from flax.linen import partitioning as nn_partitioning

  from MaxLite.models.transformer import Transformer
  from MaxLite.parallel import sharding
  from MaxLite.parallel.mesh import create_mesh
  from MaxLite.training import ensemble

  k, rows, seq = 3, 2, 16
  config = make_config(*RUN, f"ensemble_size={k}", f"max_target_length={seq}")
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, config.vocab_size, (rows, seq + 1)).astype(np.int32)
  segments = np.ones((rows, seq), np.int32)
  segments[0, 9:] = 2  # a second document
  segments[1, 11:] = 0  # padding
  positions = np.concatenate([np.arange(9), np.arange(seq - 9)])[None].repeat(rows, 0).astype(np.int32)
  positions[1, 11:] = 0
  batch = {
    "inputs": jnp.asarray(tokens[:, :-1] * (segments != 0)),
    "targets": jnp.asarray(tokens[:, 1:] * (segments != 0)),
    "inputs_position": jnp.asarray(positions),
    "inputs_segmentation": jnp.asarray(segments),
    "targets_segmentation": jnp.asarray(segments),
  }
  model = Transformer(config)
  members = []
  for i in range(k):
    params = model.init(jax.random.key(i), batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    scale = (1.0, 6.0, 20.0)[i]  # sharper and sharper predictions, each member its own
    members.append(jax.tree.map(lambda w, s=scale: w * s, nn.unbox(params["params"])))

  # numpy, float64: each member's log-probabilities of the targets, then log(mean_i p_i) per real token.
  log_p = []
  for params in members:
    logits = np.asarray(
      model.apply({"params": params}, batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"]),
      np.float64,
    )
    logits -= logits.max(-1, keepdims=True)
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    log_p.append(np.take_along_axis(log_softmax, np.asarray(batch["targets"])[..., None], -1)[..., 0])
  log_p = np.stack(log_p)  # [k, rows, seq]
  real = segments != 0
  expected = -np.log(np.exp(log_p).mean(0))[real].mean()
  expected_members = [-m[real].mean() for m in log_p]
  # The members differ: averaging their probabilities is not averaging their log-probabilities.
  assert expected < np.mean(expected_members) - 0.05

  mesh = create_mesh(config, first_devices(1))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding.axis_rules(config)):
    stacked = jax.tree.map(lambda *w: jnp.stack(w), *members)
    totals = ensemble.eval_sums(stacked, batch, apply_fn=model.apply, config=config)
  got = ensemble.eval_metrics(jax.device_get(totals))
  np.testing.assert_allclose(got["eval_ensemble_loss"], expected, rtol=1e-5)
  np.testing.assert_allclose([got[f"eval_loss/member_{i}"] for i in range(k)], expected_members, rtol=1e-5)
  np.testing.assert_allclose(got["eval_loss"], np.mean(expected_members), rtol=1e-5)


def _bytes_read() -> int:
  """Bytes this process has read through system calls so far (Linux), page cache hits included."""
  with open("/proc/self/io") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads through Linux's /proc/self/io")
@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")  # the whole stack, compared on host
def test_one_member_is_read_alone(tmp_path):
  """Decoding or exporting member 2 of four saved split over the ensemble axis reads that member's bytes (not the
  four members') and returns exactly its slice of the stacked parameters."""
  import jax
  import orbax.checkpoint as ocp
  from flax.linen import partitioning as nn_partitioning

  from MaxLite.checkpoint import lora_steps
  from MaxLite.checkpoint import manager as checkpointing
  from MaxLite.models import build
  from MaxLite.parallel import sharding
  from MaxLite.parallel.mesh import create_mesh

  _train(
    tmp_path,
    "ens4",
    "ensemble_size=4",
    "ici_ensemble_parallelism=4",
    "enable_checkpointing=true",
    "steps=1",
    "per_device_batch_size=1",
    num_devices=4,
  )
  step = str(tmp_path / "ens4" / "checkpoints" / "1")
  config = make_config(*RUN, f"load_parameters_path={step}", "ensemble_member=2")
  mesh = create_mesh(config, first_devices(1))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding.axis_rules(config)):
    params = build.parameters(config, mesh, stored=False)
    target = checkpointing.sharded_target(params.abstract, params.shardings)
    member_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(target))
    before = _bytes_read()
    loaded = lora_steps.load_params(step, target, 2)
    read = _bytes_read() - before
  assert read < 1.5 * member_bytes, (read, member_bytes)  # was 4x: every member read and held

  with ocp.PyTreeCheckpointer() as checkpointer:
    every = checkpointer.restore(str(tmp_path / "ens4" / "checkpoints" / "1" / "state"))["params"]
  for got, stacked in zip(jax.tree.leaves(loaded), jax.tree.leaves(every)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(stacked)[2])
  assert all(a.sharding == t.sharding for a, t in zip(jax.tree.leaves(loaded), jax.tree.leaves(target)))


@pytest.mark.parametrize(
  "overrides, message",
  [
    (
      ("ensemble_size=3", "ici_ensemble_parallelism=2", "ici_fsdp_parallelism=4"),
      "ensemble_size=3 does not divide over the ensemble mesh axis of 2",
    ),
    (("ensemble_size=2", "ensemble_learning_rates=[1e-3]"), "ensemble_learning_rates has 1 values for ensemble_size=2"),
    (("ensemble_size=2", "ensemble_member=1"), "ensemble_member=1 without load_parameters_path: it picks a member"),
    (("ensemble_learning_rates=[1e-3]",), "ensemble_learning_rates has 1 values but ensemble_size=1"),
    (("ensemble_member=-2",), "ensemble_member=-2 is out of range"),
    (("ensemble_size=2", "ensemble_data=shuffled"), "ensemble_data='shuffled' is not one of: 'same', 'distinct'"),
    (("ensemble_size=2", "enable_lora=true"), "ensemble_size=2 with enable_lora=true: LoRA is not supported"),
  ],
)
def test_bad_ensemble_keys_are_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
    make_config(*overrides, num_devices=8)


def test_cli_refuses_a_bad_ensemble_with_exit_2():
  out = run_train_cli("ensemble_size=4", "ensemble_learning_rates=[1e-3,2e-3]", timeout=120)
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [
    "error: ensemble_learning_rates has 2 values for ensemble_size=4: give one peak rate per member"
  ]
