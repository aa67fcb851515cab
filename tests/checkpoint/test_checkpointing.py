"""Orbax checkpoints: a run stopped and resumed from its checkpoint continues exactly."""

import json
import logging
import os
import re
import shutil

import jax
import numpy as np
import pytest
from flax.linen import partitioning as nn_partitioning
from support.config import TINY, first_devices, make_config
from support.end_to_end import procs

from MaxLite.checkpoint.info import describe
from MaxLite.checkpoint.manager import select_iterator_state, step_numbers
from MaxLite.cli.errors import CheckpointError, ConfigError
from MaxLite.data import input_pipeline
from MaxLite.parallel import sharding as sharding_lib
from MaxLite.parallel.mesh import create_mesh
from MaxLite.training import builder
from MaxLite.training.evaluation import evaluate
from MaxLite.training.metrics import NonFiniteLossError
from MaxLite.training.train_step import jit_eval_step
from MaxLite.training.trainer import initial_state, train

BASE = (
  *TINY,
  "per_device_batch_size=4",
  "learning_rate=1e-2",
  "learning_rate_schedule_steps=8",
  "eval_interval=-1",  # no eval: the tests that evaluate ask for it
)


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_params_only_load_gives_source_eval_loss(tmp_path):
  args = (*BASE, "dataset_type=grain", "eval_steps=2", f"base_output_directory={tmp_path}")
  rows = train(
    make_config(*args, "run_name=src", "steps=4", "eval_interval=4", "enable_checkpointing=true"), first_devices(1)
  )
  source_eval = [r["eval_loss"] for r in rows if "eval_loss" in r][-1]
  config = make_config(*args, "run_name=ft", f"load_parameters_path={tmp_path}/src/checkpoints/4")
  mesh = create_mesh(config, first_devices(1))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    pieces = builder.training(config, mesh)
    state, step = initial_state(config, pieces)
    eval_fn = jit_eval_step(
      config,
      pieces.model.apply,
      pieces.shardings.params,
      sharding_lib.batch_sharding(mesh, config),
      sharding_lib.replicated(mesh),
    )
    loaded_eval = evaluate(config, mesh, eval_fn, state.params)["eval_loss"]
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


@pytest.mark.slow
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


def test_load_path_naming_a_checkpoints_or_run_folder_reads_its_newest_step(tmp_path, saved_run):
  """README commands say `load_parameters_path=outputs/r1/checkpoints` and run whatever step the run ended on."""
  for folder in (f"{saved_run}/checkpoints", f"{saved_run}/checkpoints/", str(saved_run)):
    config = make_config(*BASE, f"base_output_directory={tmp_path}", f"load_full_state_path={folder}")
    assert config.load_full_state_path == f"{saved_run}/checkpoints/2"
  pinned = make_config(*BASE, f"base_output_directory={tmp_path}", f"load_parameters_path={saved_run}/checkpoints/1")
  assert pinned.load_parameters_path == f"{saved_run}/checkpoints/1"


def test_load_path_that_is_not_a_step_directory_says_so(tmp_path):
  (tmp_path / "empty").mkdir()
  config = make_config(*BASE, f"base_output_directory={tmp_path}", f"load_full_state_path={tmp_path}/empty")
  with pytest.raises(CheckpointError, match=r"empty is not a checkpoint step directory$"):
    train(config, first_devices(1))


def _corrupt(step_dir, how):
  """Damages a saved step as a disk or an interrupted copy would: array data overwritten, or files missing."""
  if how == "garbage":
    for blob in (step_dir / "state").rglob("d/*"):
      blob.write_bytes(b"not a checkpoint")
  elif how == "no_metadata":
    (step_dir / "state" / "_METADATA").unlink()
  else:
    for record in (step_dir / "data_iter").iterdir():
      record.unlink()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["garbage", "no_metadata", "no_data_position"])
def test_unreadable_newest_step_falls_back_to_the_previous_one(tmp_path, saved_run, caplog, how):
  """Resuming skips an unreadable step 2 with a warning, continues exactly as a resume from step 1
  does, and leaves step 2's files as they were (a later save does not overwrite them)."""
  shutil.copytree(saved_run, tmp_path / "r")
  shutil.copytree(saved_run, tmp_path / "ref")
  shutil.rmtree(tmp_path / "ref" / "checkpoints" / "2")
  _corrupt(tmp_path / "r" / "checkpoints" / "2", how)
  kept = _listing(tmp_path / "r" / "checkpoints" / "2")
  args = (*BASE, "dataset_type=synthetic", "steps=3", "checkpoint_period=1", "enable_checkpointing=true")
  with caplog.at_level(logging.WARNING):
    fell_back = train(make_config(*args, f"base_output_directory={tmp_path}", "run_name=r"), first_devices(1))
  reference = train(make_config(*args, f"base_output_directory={tmp_path}", "run_name=ref"), first_devices(1))
  assert [r["step"] for r in fell_back] == [2, 3]
  assert losses(fell_back) == losses(reference)  # bit for bit
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any(re.search(r"skipping checkpoint step 2, .*checkpoints/2\S* could not be read \(\w+", w) for w in warnings)
  assert _listing(tmp_path / "r" / "checkpoints" / "2") == kept
  assert sorted(os.listdir(tmp_path / "r" / "checkpoints")) == ["1", "2", "3"]


def test_a_checkpoint_of_another_model_is_an_error_not_a_fallback(tmp_path, saved_run):
  run = tmp_path / "r"
  shutil.copytree(saved_run, run)
  for step in ("1", "2"):  # no saved configs, so the arrays themselves are compared
    (run / "checkpoints" / step / "config" / "config.json").unlink()
  before = _listing(run)
  config = make_config(
    *BASE,
    "dataset_type=synthetic",
    "base_mlp_dim=128",
    "steps=3",
    "enable_checkpointing=true",
    f"base_output_directory={tmp_path}",
    "run_name=r",
  )
  with pytest.raises(CheckpointError, match=r"checkpoints/2/state: '.*wi_0\.kernel' has shape \(2, 64, 192\) in the"):
    train(config, first_devices(1))
  assert _listing(run) == before


@pytest.mark.slow
def test_no_readable_checkpoint_is_one_line_and_nothing_is_deleted(tmp_path, saved_run):
  run = tmp_path / "r"
  shutil.copytree(saved_run, run)
  for step in ("1", "2"):
    _corrupt(run / "checkpoints" / step, "garbage")
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
  output = procs.tail(log, lines=50)
  assert code == 2, output
  assert "Traceback" not in output
  errors = [line for line in output.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, output
  assert re.match(
    r"error: no checkpoint in .*checkpoints could be read \(step 2: checkpoint .*checkpoints/2\S* could not be "
    r"read \(.+; step 1: checkpoint .*checkpoints/1\S* could not be read \(.+\); move the step directories aside",
    errors[0],
  ), output
  assert _listing(run) == before


def test_data_positions_of_all_processes_merge_into_one_for_any_topology():
  saved = {
    i: {
      "process_index": i,
      "process_count": 2,
      "state": {"num_slots": 4, "slots": {str(2 * i): [5, 0], str(2 * i + 1): [6, i]}},
    }
    for i in range(2)
  }
  merged = select_iterator_state(saved, "/c/8")
  assert merged == {"num_slots": 4, "slots": {"0": [5, 0], "1": [6, 0], "2": [5, 0], "3": [6, 1]}}
  same = {0: {"process_index": 0, "process_count": 1, "state": {"step": 3}}}
  assert select_iterator_state(same, "/c/8") == {"step": 3}  # synthetic data: a step count
  with pytest.raises(CheckpointError, match="has no data iterator state"):
    select_iterator_state({}, "/c/8")


def test_a_step_whose_update_is_not_finite_is_never_saved(tmp_path):
  """A learning rate past float32's range turns step 1's parameters into Inf while its loss and gradient
  norm (computed before the update) are finite: the save of step 1 must see that and stop instead."""
  config = make_config(
    *BASE,
    "dataset_type=synthetic",
    "learning_rate=1e39",
    "warmup_steps_fraction=0",
    "gradient_clipping_threshold=0",
    "steps=3",
    "checkpoint_period=1",
    "enable_checkpointing=true",
    f"base_output_directory={tmp_path}",
    "run_name=r",
  )
  with pytest.raises(NonFiniteLossError, match=r"^step 1: its update left NaN/Inf .*; stopping without saving it"):
    train(config, first_devices(1))
  assert step_numbers(str(tmp_path / "r" / "checkpoints")) == []


@pytest.mark.slow
def test_load_full_state_continues_like_a_resume_of_that_step(tmp_path):
  """load_full_state_path=<run a's step 2> trains steps 3 and 4 exactly as resuming run a from step 2
  does when its data position is put back to the start (a full-state load keeps step and optimizer,
  and starts the data over)."""
  args = (*BASE, "dataset_type=synthetic", "checkpoint_period=2", "enable_checkpointing=true", "steps=4")
  out = f"base_output_directory={tmp_path}"
  train(make_config(*args, out, "run_name=a"), first_devices(1))
  shutil.copytree(tmp_path / "a", tmp_path / "ref")
  shutil.rmtree(tmp_path / "ref" / "checkpoints" / "4")
  config = make_config(*args, out, "run_name=ref")
  mesh = create_mesh(config, first_devices(1))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    batches = input_pipeline.make_iterator(config, mesh, "train")
    start = batches.get_state()
    batches.close()
  record_file = tmp_path / "ref" / "checkpoints" / "2" / "data_iter" / "process_0-of-1.json"
  record = json.loads(record_file.read_text())
  assert record["state"] != start  # step 2 moved the data on
  record_file.write_text(json.dumps({**record, "state": start}))
  resumed = train(config, first_devices(1))
  loaded = train(
    make_config(*args, out, "run_name=ft", f"load_full_state_path={tmp_path}/a/checkpoints/2"), first_devices(1)
  )
  assert [r["step"] for r in loaded] == [r["step"] for r in resumed] == [3, 4]
  assert losses(loaded) == losses(resumed)  # bit for bit: same weights, optimizer moments, step and batches
  assert step_numbers(str(tmp_path / "ft" / "checkpoints")) == [4]


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


@pytest.fixture
def asyncio_log():
  """The asyncio logger as it was before the test (a failed save may leave its filter there)."""
  logger = logging.getLogger("asyncio")
  level, filters = logger.level, list(logger.filters)
  yield logger
  logger.setLevel(level)
  logger.filters[:] = filters


def _never_retrieved(error):
  """Logs asyncio's 'Future exception was never retrieved' for `error`, as when orbax's write tasks are collected."""
  import asyncio

  loop = asyncio.new_event_loop()
  future = loop.create_future()
  future.set_exception(error)
  loop.close()
  del future  # collected now: asyncio logs the exception nobody retrieved


def test_a_failed_save_quiets_its_own_write_tasks_not_the_asyncio_log(tmp_path, caplog, asyncio_log):
  """Orbax's other write tasks of a failed save fail the same way, and asyncio would log each one's traceback after
  the one line the save's error becomes; those stay quiet, but asyncio's log of any other error still comes out."""
  import resource

  from MaxLite.checkpoint.manager import Saves, create_manager
  from MaxLite.data.synthetic import SyntheticIterator

  config = make_config(*BASE, "enable_checkpointing=true", f"base_output_directory={tmp_path}", "run_name=r")
  saves = Saves(create_manager(config))
  state = {"w": jax.numpy.asarray(np.random.default_rng(0).standard_normal((512, 1024), np.float32))}  # 2 MiB
  batches = SyntheticIterator(global_batch=1, rows=[0], seq_len=8, vocab_size=config.vocab_size, seed=0)
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # files of 1 MiB at most: the state cannot be written
  try:
    with pytest.raises(CheckpointError, match=r"saving checkpoint step 1 to \S+/checkpoints/1 failed \(ValueError"):
      saves.save(1, state, batches, config)
      saves.wait()
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    saves.close(raise_errors=False)
  sibling = f'OUT_OF_RANGE: Error writing "w/1.0" in OCDBT database at local file "{tmp_path}/r/checkpoints/1.orbax-'
  caplog.clear()
  _never_retrieved(ValueError(sibling + 'checkpoint-tmp/state/ocdbt.process_0/": File too large'))
  _never_retrieved(ValueError("unrelated: a bug elsewhere"))
  _never_retrieved(KeyError(f"{tmp_path}/r/checkpoints/1/other"))  # another type: not the save's failure
  logged = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
  assert len(logged) == 2 and "a bug elsewhere" in logged[0] and "checkpoints/1/other" in logged[1], logged
