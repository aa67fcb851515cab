"""The decoder as a Flax NNX module (MaxLite/training/nnx_module.py): sharded by its own partition metadata, an NNX
user's training step equals MaxLite's, and its parameters go to and from MaxLite checkpoints unchanged."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from support.config import first_devices, make_config

from MaxLite.checkpoint import lora_steps
from MaxLite.checkpoint.manager import sharded_target
from MaxLite.cli.errors import ConfigError
from MaxLite.data import input_pipeline
from MaxLite.models import build
from MaxLite.objectives import cross_entropy as loss_lib
from MaxLite.parallel import sharding as sharding_lib
from MaxLite.parallel.mesh import create_mesh
from MaxLite.training import builder, nnx_module
from MaxLite.training.optimizer import create_optimizer
from MaxLite.training.trainer import initial_state, train

# fsdp over all 8 devices (base.yml's ici_fsdp_parallelism=-1); no warmup, so the first step moves every weight.
TINY = (
  "model_name=tiny",
  "max_target_length=32",
  "per_device_batch_size=1",
  "dataset_type=synthetic",
  "eval_interval=-1",  # the last step's eval: not what these tests compare
  "warmup_steps_fraction=0",
  "enable_tensorboard=false",
)


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _assert_trees_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  jax.tree.map(np.testing.assert_array_equal, _host(actual), _host(expected))


@pytest.mark.slow
def test_nnx_training_step_on_fsdp_mesh_equals_maxlites(tmp_path):
  config = make_config(*TINY, f"base_output_directory={tmp_path}", "enable_checkpointing=false", num_devices=8)
  mesh = create_mesh(config, first_devices(8))
  model = nnx_module.nnx_model(config)

  # Sharded the way an NNX user does it: the module's logical partition specs, mapped by the config's rules.
  state = nnx.state(model)
  specs = nnx.get_partition_spec(state)
  nnx.update(model, jax.device_put(state, nn.logical_to_mesh_sharding(specs, mesh, sharding_lib.axis_rules(config))))
  kernel = model.decoder["layers"]["mlp"]["wi_0"]["kernel"]
  assert kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")
  assert len(kernel[...].sharding.device_set) == 8
  assert kernel[...].addressable_shards[0].data.shape == (2, 64 // 8, 192)

  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    pieces = builder.training(config, mesh)
    maxlite_state, _ = initial_state(config, pieces)
    _assert_trees_equal(nnx_module.params_from_nnx(model), maxlite_state.params)  # step 0's values
    before = _host(maxlite_state.params)  # the step donates them
    batch = next(iter(input_pipeline.make_iterator(config, mesh, "train")))
    maxlite_state, metrics = pieces.step(maxlite_state, batch)

    optimizer = nnx.Optimizer(model, create_optimizer(config), wrt=nnx.Param)

    def loss_fn(model, batch):
      logits = model(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
      mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
      xent, z = loss_lib.loss_sums(logits, batch["targets"], mask, config.z_loss_multiplier)
      return (xent + z) / jnp.sum(mask)

    @nnx.jit
    def train_step(model, optimizer, batch):
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      optimizer.update(model, grads)
      return loss

    loss = train_step(model, optimizer, batch)

  np.testing.assert_allclose(float(loss), float(metrics["loss"]), rtol=1e-5)
  after = _host(nnx_module.params_from_nnx(model))
  moved = jax.tree.map(lambda a, b: np.max(np.abs(a - b)), after, before)
  assert min(jax.tree.leaves(moved)) > 1e-4  # the step changed every parameter
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), after, _host(maxlite_state.params))
  assert len(model.decoder["layers"]["mlp"]["wi_0"]["kernel"][...].sharding.device_set) == 8  # still sharded


@pytest.mark.slow
def test_checkpoints_round_trip_through_the_nnx_module(tmp_path):
  args = (*TINY, f"base_output_directory={tmp_path}")
  train(make_config(*args, "run_name=src", "steps=1", "enable_checkpointing=true", num_devices=8), first_devices(8))
  step_dir = str(tmp_path / "src" / "checkpoints" / "1")
  config = make_config(*args, "enable_checkpointing=false", num_devices=8)
  mesh = create_mesh(config, first_devices(8))

  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    parameters = build.parameters(config, mesh)
    saved = _host(lora_steps.load_params(step_dir, sharded_target(parameters.abstract, parameters.shardings)))
  model = nnx_module.nnx_model(config, mesh)
  same_place = jax.tree.map(
    lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), nnx_module.params_from_nnx(model), parameters.shardings
  )
  assert all(jax.tree.leaves(same_place))  # made where MaxLite keeps them
  fresh = _host(nnx_module.params_from_nnx(model))
  nnx_module.load_checkpoint(model, step_dir)
  _assert_trees_equal(nnx_module.params_from_nnx(model), saved)
  assert not np.array_equal(fresh["decoder_norm"]["scale"], saved["decoder_norm"]["scale"])  # step 1's, not init's

  changed = jax.tree.map(lambda a: a * 2 + 1, saved)
  nnx_module.load_params_into(model, changed)
  export = nnx_module.save_checkpoint(model, config, str(tmp_path / "export"))
  loading = make_config(*args, "run_name=dst", "enable_checkpointing=false", f"load_parameters_path={export}")
  loading_mesh = create_mesh(loading, first_devices(1))
  with jax.set_mesh(loading_mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(loading)):
    state, step = initial_state(loading, builder.training(loading, loading_mesh))
  assert step == 0
  _assert_trees_equal(state.params, changed)


@pytest.mark.parametrize(
  "overrides, num_devices, message",
  [
    (("enable_lora=true",), 1, r"^enable_lora=true is not supported by the NNX module"),
    (("ici_pipeline_parallelism=2",), 8, r"^ici_pipeline_parallelism x dcn_pipeline_parallelism = 2 is not supported"),
    (("ensemble_size=2",), 1, r"^ensemble_size=2: the NNX module is one model"),
  ],
)
def test_unsupported_configs_are_one_line_config_errors(overrides, num_devices, message):
  config = make_config("model_name=tiny", *overrides, num_devices=num_devices)
  with pytest.raises(ConfigError, match=message) as error:
    nnx_module.nnx_model(config)
  assert "\n" not in str(error.value)


def test_params_that_do_not_fit_the_module_are_named():
  model = nnx_module.nnx_model(make_config(*TINY, num_devices=1))
  params = _host(nnx_module.params_from_nnx(model))
  wider = {**params, "decoder_norm": {"scale": np.zeros(65, np.float32)}}
  with pytest.raises(ValueError, match=r"params' 'decoder_norm/scale' has shape \(65,\), the NNX module's \(64,\)"):
    nnx_module.load_params_into(model, wider)
  with pytest.raises(ValueError, match=r"params have no 'logits_dense/kernel'"):
    nnx_module.load_params_into(model, {k: v for k, v in params.items() if k != "logits_dense"})
