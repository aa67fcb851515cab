"""Tensor, sequence, expert and pipeline parallelism: every layout trains like one device; MoE routing math."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import partitioning as nn_partitioning
from support.config import BASE_YML, REPO, first_devices, make_config
from support.layouts import DENSE, RUN, cached_rows, loss_curves, train_layout

from MaxLite.aot.compile_step import lower_train_step
from MaxLite.cli.errors import ConfigError
from MaxLite.layers.moe import MoeBlock, expert_capacity, load_balance_loss, route
from MaxLite.models.flops import training_flops_per_step
from MaxLite.models.transformer import Transformer
from MaxLite.parallel import sharding as sharding_lib
from MaxLite.parallel.mesh import create_mesh
from MaxLite.training.optimizer import create_optimizer
from MaxLite.training.train_state import abstract_state

MOE = ("model_name=tiny-moe",)


# The one-device references: support.layouts.cached_rows, run once per test process for every file that asks for the
# same overrides.
@pytest.fixture(scope="module")
def dense_reference():
  return loss_curves(cached_rows(1, *DENSE, "per_device_batch_size=8"))


@pytest.fixture(scope="module")
def moe_reference():
  return loss_curves(cached_rows(1, *MOE, "sparse_matmul=false", "per_device_batch_size=8"))


@pytest.mark.slow
@pytest.mark.parametrize(
  "mesh",
  [
    ("ici_tensor_parallelism=8", "ici_fsdp_parallelism=1"),
    ("ici_sequence_parallelism=4", "ici_fsdp_parallelism=2"),
    ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"),
    ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
    ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "num_pipeline_microbatches=4"),
  ],
  ids=[
    "tensor8",
    "sequence4_fsdp2",
    "stage2_fsdp4",
    "data2_fsdp2_tensor2",
    "stage2_fsdp2_tensor2_micro4",
  ],
)
def test_dense_layouts_match_single_device(tmp_path, dense_reference, mesh):
  losses, grad_norms = loss_curves(train_layout(tmp_path, 8, *DENSE, "per_device_batch_size=1", *mesh))
  np.testing.assert_allclose(losses, dense_reference[0], rtol=1e-5)
  np.testing.assert_allclose(grad_norms, dense_reference[1], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
  "mesh",
  [
    ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2"),
    ("ici_pipeline_parallelism=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2"),
  ],
  ids=["expert4_fsdp2", "stage2_expert2_fsdp2"],
)
def test_dispatch_moe_layouts_match_single_device(tmp_path, moe_reference, mesh):
  rows = train_layout(tmp_path, 8, *MOE, "sparse_matmul=false", "per_device_batch_size=1", *mesh)
  losses, grad_norms = loss_curves(rows)
  np.testing.assert_allclose(losses, moe_reference[0], rtol=1e-5)
  np.testing.assert_allclose(grad_norms, moe_reference[1], rtol=1e-5)
  assert all(r["moe_dropped_fraction"] == 0.0 for r in rows)  # capacity_factor=-1: nothing dropped


@pytest.mark.slow
@pytest.mark.parametrize(
  "mesh",
  # Each batch axis (data, fsdp, sequence, expert), tensor, stages and both grouped-matmul kernels, in 5 compiles.
  [
    ("ici_sequence_parallelism=2", "ici_data_parallelism=2", "ici_fsdp_parallelism=2"),
    ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2"),
    ("ici_expert_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2"),
    ("ici_pipeline_parallelism=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2"),
    ("megablox=false", "ici_expert_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2"),
  ],
  ids=[
    "sequence2_data2_fsdp2",
    "expert4_fsdp2",
    "expert2_tensor2_fsdp2",
    "stage2_expert2_fsdp2",
    "ragged_dot_expert2_tensor2_fsdp2",
  ],
)
def test_sparse_matmul_moe_equals_the_dense_dispatch_on_one_device(tmp_path, moe_reference, mesh):
  """Dropless grouped matmuls (each batch shard sorting its own tokens; megablox interpreted, the default, or
  ragged_dot) train like one-hot dispatch on 1 device."""
  rows = train_layout(tmp_path, 8, *MOE, "per_device_batch_size=1", *mesh)
  losses, grad_norms = loss_curves(rows)
  np.testing.assert_allclose(losses, moe_reference[0], rtol=1e-5)
  np.testing.assert_allclose(grad_norms, moe_reference[1], rtol=1e-5)
  assert all(r["moe_dropped_fraction"] == 0.0 for r in rows)


@pytest.mark.slow
def test_sparse_matmul_drops_per_expert_per_batch_shard(tmp_path):
  rows = train_layout(
    tmp_path, 1, *MOE, "sparse_matmul=true", "per_device_batch_size=2", "capacity_factor=0.25", "steps=2"
  )
  assert all(0.2 < r["moe_dropped_fraction"] < 1.0 for r in rows), rows
  # Expert parallelism with a send buffer of a quarter of each peer's even share: rows that do not fit are dropped.
  small_buffer = ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2", "ragged_buffer_factor=0.25")
  rows = train_layout(
    tmp_path, 8, *MOE, "sparse_matmul=true", "per_device_batch_size=1", "steps=2", "run_name=b", *small_buffer
  )
  assert all(0.5 < r["moe_dropped_fraction"] < 1.0 for r in rows), rows


# Router probabilities of 4 tokens over 3 experts (no ties), given as logits = log(p).
PROBS = np.array([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.15, 0.8, 0.05], [0.25, 0.15, 0.6]], np.float32)


def _route(top_k, capacity, mask=(1, 1, 1, 1)):
  return route(jnp.log(jnp.asarray(PROBS))[None], jnp.asarray([mask], jnp.float32), top_k, capacity)


def test_load_balance_loss_matches_hand_computation():
  # Top-1 picks experts 0, 0, 1, 2: f = (1/2, 1/4, 1/4). Mean probabilities P = column means of
  # PROBS = (0.425, 0.3625, 0.2125). Loss = 3 * (0.5*0.425 + 0.25*0.3625 + 0.25*0.2125) = 1.06875.
  _, _, stats = _route(top_k=1, capacity=4)
  np.testing.assert_allclose(load_balance_loss(stats), 1.06875, rtol=1e-6)
  # The last token is padding: f = (2/3, 1/3, 0), P = (1.45/3, 1.3/3, 0.3/3) over 3 tokens.
  _, _, stats = _route(top_k=1, capacity=4, mask=(1, 1, 1, 0))
  np.testing.assert_allclose(load_balance_loss(stats), 3 * (2 / 3 * 1.45 / 3 + 1 / 3 * 1.3 / 3), rtol=1e-6)
  assert float(stats["routed"]) == 3 and float(stats["dropped"]) == 0


def test_small_capacity_drops_later_choices_first_and_counts_them():
  # Top-2 with 2 slots per expert. First choices: e0 <- t0, t1; e1 <- t2; e2 <- t3. Second choices in
  # token order: t0 -> e1 (slot 1, kept), t1 -> e1 (full, dropped), t2 -> e0 (full), t3 -> e0 (full).
  dispatch, combine, stats = _route(top_k=2, capacity=2)
  assert float(stats["routed"]) == 8 and float(stats["dropped"]) == 3
  slots = {(t, e): int(np.argmax(dispatch[0, t, e])) for t in range(4) for e in range(3) if dispatch[0, t, e].sum()}
  assert slots == {(0, 0): 0, (1, 0): 1, (2, 1): 0, (0, 1): 1, (3, 2): 0}
  # Kept choices are weighted by the renormalised top-2 probabilities; dropped ones contribute nothing.
  np.testing.assert_allclose(combine[0, 0].sum(axis=-1), [0.7 / 0.9, 0.2 / 0.9, 0.0], rtol=1e-6)
  np.testing.assert_allclose(combine[0, 1].sum(axis=-1), [0.6 / 0.9, 0.0, 0.0], rtol=1e-6)
  assert expert_capacity(seq_len=64, num_experts=4, top_k=2, capacity_factor=0.25) == 8
  assert expert_capacity(seq_len=64, num_experts=4, top_k=2, capacity_factor=-1) == 64


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", [("sparse_matmul=false",), ("megablox=false",), ("megablox=true",)])
def test_moe_block_equals_per_token_loop(dispatch):
  config = make_config(*MOE, "max_target_length=16", "sparse_matmul=true", *dispatch)
  x = jax.random.normal(jax.random.key(1), (2, 16, 64))
  mask = jnp.ones((2, 16), bool)
  block = MoeBlock(config)
  params = nn.unbox(block.init(jax.random.key(0), x, mask)["params"])
  y, _ = block.apply({"params": params}, x, mask)
  probs = jax.nn.softmax(x @ params["gate"]["kernel"], axis=-1)
  expected = np.zeros_like(np.asarray(y))
  for b in range(2):
    for s in range(16):
      weights, experts = jax.lax.top_k(probs[b, s], 2)
      for w, e in zip(weights / weights.sum(), experts):
        hidden = nn.silu(x[b, s] @ params["wi_0"][e]) * (x[b, s] @ params["wi_1"][e])
        expected[b, s] += w * (hidden @ params["wo"][e])
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def _block_value_and_grads(layout, *dispatch):
  """y and d(sum y * probe)/d(params, x) of tiny-moe's MoE block on 8 x 16 tokens (the last 3 of row 0 padding)."""
  devices = 8 if layout else 1
  config = make_config(*MOE, "max_target_length=16", *layout, *dispatch, num_devices=devices)
  x = jax.random.normal(jax.random.key(1), (8, 16, 64))
  mask = jnp.ones((8, 16), bool).at[0, -3:].set(False)
  probe = jax.random.normal(jax.random.key(2), x.shape)
  block = MoeBlock(config)
  params = nn.unbox(block.init(jax.random.key(0), x, mask)["params"])

  def objective(params, x):
    y, _ = block.apply({"params": params}, x, mask)
    return jnp.sum(y * probe), y

  mesh = create_mesh(config, first_devices(devices))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    (_, y), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(params, x)
  return y, grads


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["megablox=false", "megablox=true"])
@pytest.mark.parametrize(
  "layout",
  [(), ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2"), ("ici_expert_parallelism=4", "ici_data_parallelism=2")],
  ids=["1device", "expert4_fsdp2", "expert4_data2"],
)
def test_sparse_moe_block_forward_and_gradients_equal_the_dense_dispatch(layout, kernel):
  dense_y, dense_grads = _block_value_and_grads((), "sparse_matmul=false")
  y, grads = _block_value_and_grads(layout, "sparse_matmul=true", kernel)
  assert not np.any(np.asarray(y)[0, -3:])  # padding is not routed
  # Sums over 128 tokens in another order: near-zero entries are compared at 1e-5 of their tensor's largest.
  for got, want in zip(jax.tree.leaves((y, grads)), jax.tree.leaves((dense_y, dense_grads))):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow
def test_tiny_capacity_reports_dropped_tokens(tmp_path):
  rows = train_layout(
    tmp_path, 1, *MOE, "sparse_matmul=false", "per_device_batch_size=2", "capacity_factor=0.25", "steps=2"
  )
  assert all(0.2 < r["moe_dropped_fraction"] < 1.0 for r in rows), rows
  logged = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert [r["moe_dropped_fraction"] for r in logged] == [r["moe_dropped_fraction"] for r in rows]
  assert all(r["moe_lb_loss"] >= 1.0 - 1e-6 for r in logged)  # MaxText's scale: top_k (2 here) when balanced


def test_moe_flops_count_only_active_experts():
  moe = make_config(*MOE, "max_target_length=64")
  dense = make_config(*MOE, "max_target_length=64", "num_experts=1")
  tokens, emb, mlp = moe.global_batch_size_to_train_on * 64, 64, 96
  # 2 of 4 experts run per token (2x the dense MLP) plus the router's [emb, 4] matmul; x3 for training.
  extra = 3 * moe.base_num_decoder_layers * (2 * tokens * emb * mlp * 3 + 2 * tokens * emb * 4)
  assert training_flops_per_step(moe)["total"] - training_flops_per_step(dense)["total"] == extra


def _layer_stack_bytes(*overrides):
  config = make_config(*DENSE, "base_num_decoder_layers=4", "per_device_batch_size=1", *overrides, num_devices=8)
  mesh = create_mesh(config, first_devices(8))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    abstract, _, shardings = abstract_state(Transformer(config), create_optimizer(config), config, mesh)
  layers = lambda tree: tree.params["decoder"]["layers"]
  return sharding_lib.sharded_bytes(layers(abstract), layers(shardings))


def test_two_stages_halve_the_layer_stack_per_device():
  one = _layer_stack_bytes("ici_fsdp_parallelism=4", "ici_data_parallelism=2")
  two = _layer_stack_bytes("ici_fsdp_parallelism=4", "ici_pipeline_parallelism=2")
  print(f"layer stack bytes per device: stage=1 {one}, stage=2 {two}")
  assert two * 2 == one


@pytest.mark.parametrize(
  "overrides, fragment",
  [
    (
      ("ici_pipeline_parallelism=4", "base_num_decoder_layers=6"),
      "base_num_decoder_layers=6 is not divisible by pipeline parallelism 4",
    ),
    (("ici_pipeline_parallelism=2", "scan_layers=false"), "pipeline parallelism 2 needs scan_layers=true"),
    (("ici_pipeline_parallelism=2", "num_pipeline_microbatches=3"), "num_pipeline_microbatches=3"),
    (MOE + ("ici_expert_parallelism=8",), "num_experts=4 is not divisible by expert parallelism 8"),
    (MOE + ("num_experts_per_tok=5",), "num_experts_per_tok=5 must be between 1 and num_experts=4"),
    (
      ("ici_sequence_parallelism=8", "max_target_length=100"),
      "max_target_length=100 is not divisible by sequence parallelism 8",
    ),
  ],
)
def test_invalid_layouts_fail_with_one_line(overrides, fragment):
  with pytest.raises(ConfigError, match=fragment) as error:
    make_config("model_name=tiny", "ici_fsdp_parallelism=-1", *overrides, num_devices=8)
  assert "\n" not in str(error.value)


@pytest.mark.slow
def test_print_sharding_from_the_command_line(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")  # the 8 devices and fast compiles of conftest.py
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(REPO, "MaxLite", "train.py"),
      BASE_YML,
      *MOE,
      "steps=1",
      "debug_sharding=true",
      "enable_checkpointing=false",
      "dataset_type=synthetic",
      "max_target_length=32",
      "per_device_batch_size=1",
      "ici_fsdp_parallelism=2",
      "ici_expert_parallelism=4",
      "enable_tensorboard=false",
      "jax_cache_dir=",
      f"base_output_directory={tmp_path}",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
  # Experts split 4 ways on `expert`, embed 2 ways on `fsdp` (+ sequence, size 1): (2, 4, 64, 96) -> (2, 1, 32, 96).
  wi_0 = lines["decoder/layers/moe/wi_0"]
  assert "(layers, exp, embed, mlp)" in wi_0 and "(stage, expert, fsdp+sequence, tensor)" in wi_0
  assert wi_0.rstrip().endswith("(2, 1, 32, 96)")
  assert "MiB per device" in proc.stdout


def _compiled_temp_bytes(*overrides):
  config = make_config(*DENSE, *RUN, "per_device_batch_size=1", *overrides, num_devices=8)
  lowered, _ = lower_train_step(config, first_devices(8))
  return lowered.compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_sequence_parallelism_does_not_regather_activations():
  # Splitting the sequence must not cost more activation memory than splitting the batch the same
  # number of ways (a [batch, seq] reshape once made GSPMD replicate activations: 3x the temp bytes).
  fsdp = _compiled_temp_bytes("ici_fsdp_parallelism=8")
  sequence = _compiled_temp_bytes("ici_sequence_parallelism=4", "ici_fsdp_parallelism=2")
  print(f"compiled temp bytes per device: fsdp=8 {fsdp}, sequence=4 x fsdp=2 {sequence}")
  assert sequence < 1.5 * fsdp


def test_megablox_is_compiled_on_tpu_interpreted_on_cpu_and_ragged_dot_on_gpu_unless_asked_for():
  from MaxLite import config as config_lib
  from MaxLite.config import validation

  def derive(platform, *overrides):
    raw = config_lib.load_raw([BASE_YML, *MOE, *overrides])
    return validation.validate_and_derive(raw, num_devices=1, num_slices=1, process_count=1, platform=platform)

  assert not derive("tpu")["megablox_interpret"] and derive("cpu")["megablox_interpret"]
  assert not derive("gpu")["megablox"]  # base.yml's default: a MoE model starts on a GPU, through ragged_dot
  with pytest.raises(ConfigError, match="megablox=true is a TPU kernel .* devices are gpu: use megablox=false"):
    derive("gpu", "megablox=true")
  derive("gpu", "megablox=false")
  derive("gpu", "sparse_matmul=false")  # the one-hot dispatch has no grouped matmuls
