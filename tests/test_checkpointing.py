"""Orbax checkpoints: a run stopped and resumed from its checkpoint continues exactly."""

import os
import re
import shutil
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import REPO, first_devices, make_config
from flax.linen import partitioning as nn_partitioning

from MaxLite import sharding as sharding_lib
from MaxLite.checkpoint.info import describe
from MaxLite.checkpoint.manager import select_iterator_state
from MaxLite.errors import CheckpointError, ConfigError
from MaxLite.layers.decoder import Transformer
from MaxLite.mesh import create_mesh
from MaxLite.training.optimizer import create_optimizer
from MaxLite.training.train_step import jit_eval_step
from MaxLite.training.trainer import evaluate, initial_state, train

sys.path.insert(0, os.path.join(REPO, "end_to_end"))
import procs

BASE = (
  "model_name=tiny",
  "max_target_length=64",
  "per_device_batch_size=4",
  "enable_tensorboard=false",
  "learning_rate=1e-2",
  "learning_rate_schedule_steps=8",
)


@pytest.mark.parametrize("data", ["dataset_type=synthetic", "dataset_type=grain"])
def test_resume_equals_uninterrupted_run(tmp_path, data):
  straight = train(
    make_config(*BASE, data, "steps=8", f"base_output_directory={tmp_path}", "run_name=a"), first_devices(1)
  )
  resumed_args = (
    *BASE,
    data,
    f"base_output_directory={tmp_path}",
    "run_name=b",
    "enable_checkpointing=true",
    "checkpoint_period=3",
  )
  first = train(make_config(*resumed_args, "steps=5"), first_devices(1))
  # Period 3 plus the final step: checkpoints at 3 and 5.
  assert sorted(os.listdir(tmp_path / "b" / "checkpoints")) == ["3", "5"]
  second = train(make_config(*resumed_args, "steps=8"), first_devices(1))
  assert [r["step"] for r in second] == [6, 7, 8]
  assert losses(first) + losses(second) == losses(straight)  # bit for bit


def losses(rows):
  return [r["loss"] for r in rows if "loss" in r]


def _copy_run(tmp_path, source, target):
  shutil.copytree(tmp_path / source, tmp_path / target)


def test_resharding_restore(tmp_path):
  """Saved under fsdp=8; resumed under fsdp=2 x tensor=4, pipeline stage=2 x fsdp=4 and on 1 device."""
  # 4 kv heads so that tensor=4 splits them evenly.
  args = (*BASE, "dataset_type=grain", "base_num_kv_heads=4", f"base_output_directory={tmp_path}")
  on8 = lambda *o: make_config(*args, "per_device_batch_size=1", "ici_fsdp_parallelism=8", *o, num_devices=8)
  straight = losses(train(on8("run_name=a", "steps=6"), first_devices(8)))
  train(on8("run_name=b", "steps=4", "enable_checkpointing=true"), first_devices(8))
  _copy_run(tmp_path, "b", "c")
  _copy_run(tmp_path, "b", "d")
  resumed = train(
    make_config(
      *args,
      "per_device_batch_size=1",
      "ici_fsdp_parallelism=2",
      "ici_tensor_parallelism=4",
      "run_name=b",
      "steps=6",
      "enable_checkpointing=true",
      num_devices=8,
    ),
    first_devices(8),
  )
  np.testing.assert_allclose(losses(resumed), straight[4:], rtol=1e-5)
  one_device = train(
    make_config(*args, "per_device_batch_size=8", "run_name=c", "steps=6", "enable_checkpointing=true"),
    first_devices(1),
  )
  np.testing.assert_allclose(losses(one_device), straight[4:], rtol=1e-5)
  # The pipeline keeps the scanned parameter layout, so the same checkpoint loads split into stages.
  staged = train(
    make_config(
      *args,
      "per_device_batch_size=1",
      "ici_pipeline_parallelism=2",
      "ici_fsdp_parallelism=4",
      "run_name=d",
      "steps=6",
      "enable_checkpointing=true",
      num_devices=8,
    ),
    first_devices(8),
  )
  np.testing.assert_allclose(losses(staged), straight[4:], rtol=1e-5)


def test_params_only_load_gives_source_eval_loss(tmp_path):
  args = (*BASE, "dataset_type=grain", "eval_steps=2", f"base_output_directory={tmp_path}")
  rows = train(
    make_config(*args, "run_name=src", "steps=4", "eval_interval=4", "enable_checkpointing=true"), first_devices(1)
  )
  source_eval = [r["eval_loss"] for r in rows if "eval_loss" in r][-1]
  config = make_config(*args, "run_name=ft", f"load_parameters_path={tmp_path}/src/checkpoints/4")
  mesh = create_mesh(config, first_devices(1))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    model, tx = Transformer(config), create_optimizer(config)
    state, shardings, step = initial_state(config, mesh, model, tx, None, None)
    eval_fn = jit_eval_step(
      config,
      Transformer(config).apply,
      shardings.params,
      sharding_lib.batch_sharding(mesh, config),
      sharding_lib.replicated(mesh),
    )
    loaded_eval = evaluate(config, mesh, eval_fn, state.params)
  assert step == 0 and int(state.step) == 0
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state.opt_state))  # fresh Adam moments, count 0
  assert loaded_eval == pytest.approx(source_eval, rel=1e-6)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
  """A finished 2-step tiny run with checkpoints at steps 1 and 2."""
  out = tmp_path_factory.mktemp("saved")
  train(
    make_config(
      *BASE,
      "dataset_type=synthetic",
      "steps=2",
      "checkpoint_period=1",
      f"base_output_directory={out}",
      "run_name=r",
      "enable_checkpointing=true",
    ),
    first_devices(1),
  )
  return out / "r"


def _listing(root):
  return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file())


def test_load_path_that_does_not_exist(tmp_path):
  config = make_config(*BASE, f"base_output_directory={tmp_path}", "load_parameters_path=/nonexistent/ckpt/5")
  with pytest.raises(CheckpointError, match=r"load_parameters_path=/nonexistent/ckpt/5: no such directory"):
    train(config, first_devices(1))


def test_load_path_names_a_mismatched_parameter_and_both_shapes(tmp_path, saved_run):
  config = make_config(
    *BASE, "base_mlp_dim=128", f"base_output_directory={tmp_path}", f"load_parameters_path={saved_run}/checkpoints/2"
  )
  before = _listing(saved_run)
  with pytest.raises(
    CheckpointError,
    match=r"'params\.decoder\.layers\.mlp\.wi_0\.kernel' has shape \(2, 64, 192\) "
    r"in the checkpoint but \(2, 64, 128\) in this config",
  ):
    train(config, first_devices(1))
  assert _listing(saved_run) == before


def test_load_path_that_is_not_a_step_directory_lists_steps(tmp_path, saved_run):
  config = make_config(*BASE, f"base_output_directory={tmp_path}", f"load_full_state_path={saved_run}/checkpoints")
  with pytest.raises(CheckpointError, match=r"is not a checkpoint step directory \(it holds steps \[2, 1\]"):
    train(config, first_devices(1))


def test_corrupt_checkpoint_is_one_line_and_nothing_is_deleted(tmp_path, saved_run):
  run = tmp_path / "r"
  shutil.copytree(saved_run, run)
  for blob in (run / "checkpoints" / "2" / "state").rglob("d/*"):
    blob.write_bytes(b"not a checkpoint")
  before = _listing(run)
  log = str(tmp_path / "log")
  code = procs.run(
    procs.train_command(
      *BASE,
      "dataset_type=synthetic",
      "steps=3",
      "enable_checkpointing=true",
      f"base_output_directory={tmp_path}",
      "run_name=r",
    ),
    log,
  )
  output = procs.tail(log, lines=5)
  assert code == 2, output
  assert "Traceback" not in output
  assert re.search(
    r"^error: checkpoint .*checkpoints/2(/state)? could not be read \(.+\); move that step directory aside",
    output,
    re.MULTILINE,
  ), output
  assert _listing(run) == before


def test_changed_process_count_is_refused_unless_data_order_is_process_invariant():
  saved = {i: {"process_index": i, "process_count": 2, "state": {"parent": {"next_index": 10 + i}}} for i in range(2)}
  grain_like = SimpleNamespace(process_invariant=False)
  with pytest.raises(
    CheckpointError,
    match=r"written by 2 data-loading processes but this run has 1; .* Resume with 2 "
    r"processes, or start a new run_name with load_full_state_path=/c/8",
  ):
    select_iterator_state(saved, "/c/8", grain_like)
  assert select_iterator_state(saved, "/c/8", SimpleNamespace(process_invariant=True)) == {"parent": {"next_index": 10}}
  same = {0: {"process_index": 0, "process_count": 1, "state": {"step": 3}}}
  assert select_iterator_state(same, "/c/8", grain_like) == {"step": 3}


def test_both_load_paths_is_a_config_error():
  with pytest.raises(ConfigError, match="load_parameters_path and load_full_state_path are mutually exclusive"):
    make_config("load_parameters_path=/a", "load_full_state_path=/b")


def test_checkpoint_info_lists_steps_shapes_and_bytes(saved_run):
  text = describe(str(saved_run))
  assert f"{saved_run / 'checkpoints'}: steps 1, 2" in text and "step 2:" in text
  assert "params: 1,147,200 values, 4.4 MiB" in text  # the tiny model, float32
  assert re.search(r"logits_dense\.kernel +\(64, 8192\) +float32 +2\.0 MiB", text)
  assert "model_name=tiny" in text and "data iterator: process_0-of-1.json" in text
  with pytest.raises(CheckpointError, match=r"step 7 is not in .*; complete steps: 1, 2"):
    describe(str(saved_run), step=7)
