"""Layouts whose batch shards hold one or two rows train like one device, in every family, with gradient accumulation
and vocab tiling: the sweep that finds XLA's batch-shard swap (sharding.swaps_batch_shards), which reached training
on data x fsdp x tensor meshes unnoticed while the layout tests ran at four rows per shard."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import partitioning as nn_partitioning
from jax.sharding import Mesh, NamedSharding
from support.config import first_devices, make_config

from MaxLite.parallel import sharding as sharding_lib
from MaxLite.parallel.mesh import create_mesh
from MaxLite.training.trainer import train

RUN = (
  "max_target_length=32",
  "steps=2",
  "dataset_type=synthetic",
  "eval_interval=-1",  # the last step's eval: not what these tests compare
  "enable_tensorboard=false",
  "enable_checkpointing=false",
  "learning_rate=1e-2",
  "warmup_steps_fraction=0.0",
  "dtype=float32",
)
FAMILIES = ("tiny", "tiny-gemma3", "tiny-moe", "tiny-deepseek")
LAYOUT = ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")
# The keys on 8 devices (4 batch shards) and the global batch they make, which the one-device run takes whole: one row
# per batch shard; two 1-row microbatches with the logits in 2 vocab tiles; 2 rows per shard in 2 vocab tiles.
CASES = {
  "one_row": (("per_device_batch_size=0.5",), 4),
  "accumulation_vocab_tiles": (("per_device_batch_size=0.5", "gradient_accumulation_steps=2", "num_vocab_tiling=2"), 8),
  "two_rows_vocab_tiles": (("per_device_batch_size=1", "num_vocab_tiling=2"), 8),
}


def _losses(tmp_path, num_devices, *overrides):
  config = make_config(*RUN, f"base_output_directory={tmp_path}", "run_name=run", *overrides, num_devices=num_devices)
  rows = train(config, first_devices(num_devices))
  return np.array([[r["loss"], r["grad_norm"]] for r in rows])


# Each family at one row per batch shard (where XLA's swap showed) and in one of the two vocab-tiled cases: each case
# in two families, a dense and a MoE one.
CASES_OF = {
  "tiny": ("one_row", "accumulation_vocab_tiles"),
  "tiny-gemma3": ("one_row", "two_rows_vocab_tiles"),
  "tiny-moe": ("one_row", "two_rows_vocab_tiles"),
  "tiny-deepseek": ("one_row", "accumulation_vocab_tiles"),
}


def test_every_family_and_case_is_run():
  assert set(CASES_OF) == set(FAMILIES) and {c for cases in CASES_OF.values() for c in cases} == set(CASES)
  assert all("one_row" in cases for cases in CASES_OF.values())


@pytest.mark.slow
@pytest.mark.parametrize("model", FAMILIES)
def test_one_and_two_row_batch_shards_train_like_one_device(tmp_path, model):
  family = (f"model_name={model}",) + (("sparse_matmul=false",) if "moe" in model or "deepseek" in model else ())
  one_device = {rows: _losses(tmp_path / f"one{rows}", 1, *family, f"per_device_batch_size={rows}") for rows in (4, 8)}
  for name in CASES_OF[model]:
    keys, rows = CASES[name]
    sharded = _losses(tmp_path / name, 8, *family, *LAYOUT, *keys)
    np.testing.assert_allclose(sharded, one_device[rows], rtol=2e-5, err_msg=f"{model} {name}: [loss, grad_norm]")


def _swap_reproduction(mesh: Mesh, rules, batch: int) -> float:
  """Max error of `bsm,me->bse` and its gradients (the output projection of an MLP: x[batch, length, mlp],
  w[mlp, embed]) under `rules`, against one device."""
  x = np.random.RandomState(0).randn(batch, 8, 16).astype(np.float32)
  w = np.random.RandomState(1).randn(16, 128).astype(np.float32)
  g = np.random.RandomState(2).randn(batch, 8, 128).astype(np.float32)

  def spec(*logical):
    return NamedSharding(mesh, nn_partitioning.logical_to_mesh_axes(logical, rules))

  def f(x, w):
    y = jnp.einsum("bsm,me->bse", x, w)
    y = jax.lax.with_sharding_constraint(y, spec("activation_batch", "activation_length", "activation_embed"))
    return jnp.sum(y * g), y

  def value_and_grads(x, w):
    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, w)

  (_, want_y), want_g = value_and_grads(x, w)
  xs = jax.device_put(x, spec("activation_batch", "activation_length", "activation_mlp"))
  ws = jax.device_put(w, spec("mlp", "embed"))
  (_, y), grads = jax.jit(value_and_grads)(xs, ws)
  return max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip((y, *grads), (want_y, *want_g)))


MESHES = [
  dict(zip(("data", "fsdp", "tensor", "expert", "sequence"), shape))
  for shape in [(2, 2, 2, 1, 1), (1, 4, 2, 1, 1), (4, 1, 2, 1, 1), (1, 2, 2, 2, 1), (2, 1, 2, 1, 2), (2, 4, 1, 1, 1)]
]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: "_".join(f"{a}{n}" for a, n in m.items() if n > 1))
def test_the_rules_training_traces_under_compute_the_right_rows(mesh_shape):
  """On each 8-device layout, XLA's rows are wrong only where swaps_batch_shards says so, and the rules training
  traces under (sharding.axis_rules) give the right rows everywhere."""
  config = make_config(*(f"ici_{a}_parallelism={n}" for a, n in mesh_shape.items()), num_devices=8)
  mesh = create_mesh(config, first_devices(8))
  raw = tuple(
    (name, axes if isinstance(axes, str) else tuple(axes) or None) for name, axes in config.logical_axis_rules
  )
  predicted = sharding_lib.swaps_batch_shards(config.logical_axis_rules, dict(zip(mesh.axis_names, mesh.devices.shape)))
  with jax.set_mesh(mesh):
    for rows in (1, 2):
      batch = rows * config.activation_batch_shards
      if _swap_reproduction(mesh, raw, batch) > 1e-3:
        assert predicted, f"{mesh_shape}: XLA swaps batch shards at {rows} row(s) a shard, swaps_batch_shards says no"
      assert _swap_reproduction(mesh, sharding_lib.axis_rules(config), batch) < 1e-3, f"{mesh_shape}, {rows} row(s)"
  assert predicted == (mesh_shape["data"] > 1 and mesh_shape["fsdp"] > 1 and mesh_shape["tensor"] > 1)
