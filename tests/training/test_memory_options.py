"""Memory options: vocabulary-tiled and -sliced losses, MLP token chunks, host offload, the largest buffers. Training
with each of them on 8 devices (exactly as the same layout without it) is a row of tests/parallel/
test_feature_layouts.py; here are their math, their memory and traffic, and their one-line errors."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.config import REPO, first_devices, make_config

from MaxLite.aot import buffer_report
from MaxLite.cli.errors import ConfigError
from MaxLite.data import BATCH_KEYS
from MaxLite.objectives import cross_entropy as loss
from MaxLite.parallel import topologies

RUN = (
  "model_name=tiny",
  "max_target_length=128",
  "steps=3",
  "dataset_type=synthetic",
  "eval_interval=-1",  # the last step's eval: not what these tests compare
  "enable_tensorboard=false",
  "learning_rate=1e-2",
  "warmup_steps_fraction=0.0",
  "z_loss_multiplier=1e-3",
  "enable_checkpointing=false",
)


@pytest.mark.parametrize("split, n", [("tokens", 2), ("tokens", 8), ("vocabulary", 2), ("vocabulary", 8)])
def test_split_losses_and_gradients_equal_the_whole_ones(split, n):
  keys = jax.random.split(jax.random.key(1), 3)
  hidden = jax.random.normal(keys[0], (4, 64, 32))
  head = jax.random.normal(keys[1], (32, 1000)) * 0.2
  targets = jax.random.randint(keys[2], (4, 64), 0, 1000)
  mask = jnp.ones((4, 64)).at[1, 40:].set(0.0).at[3, :5].set(0.0)
  split_loss = {"tokens": loss.tiled_loss_sums, "vocabulary": loss.vocab_sliced_loss_sums}[split]

  def whole(hidden, head):
    xent, z = loss.loss_sums(jnp.einsum("bse,ev->bsv", hidden, head), targets, mask, 1e-3)
    return xent + 7.0 * z  # distinct weights, so a mix-up of the two sums' gradients shows

  def in_parts(hidden, head):
    xent, z = split_loss(hidden, head, targets, mask, 1e-3, n)
    return xent + 7.0 * z

  (want, want_grads), (got, got_grads) = (
    jax.value_and_grad(f, argnums=(0, 1))(hidden, head) for f in (whole, in_parts)
  )
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split", ["tokens", "vocabulary"])
def test_split_losses_never_hold_the_whole_logits(split):
  hidden, head = jnp.zeros((8, 512, 64)), jnp.zeros((64, 4096))
  targets, mask = jnp.zeros((8, 512), jnp.int32), jnp.ones((8, 512))
  split_loss = {"tokens": loss.tiled_loss_sums, "vocabulary": loss.vocab_sliced_loss_sums}[split]

  def temp_bytes(fn):
    grad = jax.jit(jax.grad(lambda h, w: sum(fn(h, w)), argnums=(0, 1)))
    return grad.lower(hidden, head).compile().memory_analysis().temp_size_in_bytes

  whole = 8 * 512 * 4096 * 4  # the float32 logits
  untiled = temp_bytes(lambda h, w: loss.loss_sums(jnp.einsum("bse,ev->bsv", h, w), targets, mask, 0.0))
  in_parts = temp_bytes(lambda h, w: split_loss(h, w, targets, mask, 0.0, 16))
  assert untiled >= whole > 4 * in_parts


@pytest.mark.slow
def test_tiled_bfloat16_loss_adds_the_head_gradient_in_float32():
  keys = jax.random.split(jax.random.key(3), 3)
  hidden = jax.random.normal(keys[0], (2, 256, 32)).astype(jnp.bfloat16)
  head = jax.random.normal(keys[1], (32, 512)) * 0.2  # float32 weights, bfloat16 activations
  targets, mask = jax.random.randint(keys[2], (2, 256), 0, 512), jnp.ones((2, 256))

  def total(tiles, dtype):
    def f(head):
      h = hidden.astype(dtype)
      if tiles == 1:
        return sum(loss.loss_sums(jnp.einsum("bse,ev->bsv", h, head.astype(dtype)), targets, mask, 0.0))
      return sum(loss.tiled_loss_sums(h, head, targets, mask, 0.0, tiles))

    return jax.grad(f)(head)

  exact = total(1, jnp.float32)  # the same inputs, float32 arithmetic
  error = lambda g: float(jnp.max(jnp.abs(g - exact)))
  tiled = total(16, jnp.bfloat16)
  assert tiled.dtype == jnp.float32
  # Chunk gradients summed in bfloat16 would lose ~2^-8 of the total per chunk; in float32 the tiled gradient is
  # no further from exact than the untiled bfloat16 one.
  assert error(tiled) <= 1.5 * error(total(1, jnp.bfloat16))


def test_vocab_tiling_that_cannot_split_the_sequence_is_one_line():
  with pytest.raises(ConfigError, match=r"num_vocab_tiling=3 must divide max_target_length=128"):
    make_config(*RUN, "num_vocab_tiling=3")


def test_vocab_sliced_bfloat16_loss_is_as_close_to_exact_as_the_whole_one():
  keys = jax.random.split(jax.random.key(5), 3)
  hidden = jax.random.normal(keys[0], (2, 256, 32))
  head = jax.random.normal(keys[1], (32, 512)) * 0.2  # float32 weights, bfloat16 activations and logits
  targets, mask = jax.random.randint(keys[2], (2, 256), 0, 512), jnp.ones((2, 256))

  def grads(slices, dtype, logits_dtype):
    def f(head):
      h = hidden.astype(dtype)
      if slices == 1:
        logits = jnp.einsum("bse,ev->bsv", h, head.astype(dtype), preferred_element_type=logits_dtype)
        return sum(loss.loss_sums(logits, targets, mask, 0.0))
      return sum(loss.vocab_sliced_loss_sums(h, head, targets, mask, 0.0, slices, logits_dtype))

    return jax.grad(f)(head)

  exact = grads(1, jnp.float32, jnp.float32)
  error = lambda g: float(jnp.max(jnp.abs(g - exact)))
  sliced = grads(4, jnp.bfloat16, None)
  assert sliced.dtype == jnp.float32
  assert 0 < error(sliced) <= 1.5 * error(grads(1, jnp.bfloat16, None))


def test_auto_vocab_slices_keep_the_logits_per_device_under_256_mib():
  tiny = make_config("model_name=tiny")
  assert tiny.num_vocab_slices == -1 and tiny.vocab_slices == 1  # small logits: the whole-logits loss
  # Llama 2 7B, 2 x 8192 tokens per device, float32 logits: 2 GB of logits -> 8 slices of 250 MiB.
  llama = ("model_name=llama2-7b", "per_device_batch_size=2", "max_target_length=8192", "dtype=bfloat16")
  assert make_config(*llama, "ici_fsdp_parallelism=4", num_devices=4).vocab_slices == 8
  assert make_config(*llama, "logits_dot_in_fp32=false", num_devices=1).vocab_slices == 4
  assert make_config(*llama, "num_vocab_tiling=4").vocab_slices == 1  # token tiling already splits them
  assert make_config(*llama, "num_vocab_slices=1").vocab_slices == 1


@pytest.mark.parametrize(
  "overrides, error",
  [
    (("num_vocab_slices=3",), r"num_vocab_slices=3 must be -1 \(auto\) or a positive divisor of vocab_size=8192"),
    (("num_vocab_slices=0",), r"num_vocab_slices=0 must be -1"),
    (("num_vocab_slices=2", "num_vocab_tiling=2"), r"split the logits two ways; set one of them to 1"),
  ],
)
def test_bad_vocab_slices_are_one_line(overrides, error):
  with pytest.raises(ConfigError, match=error):
    make_config(*RUN, *overrides)


def test_mlp_in_token_chunks_never_holds_all_its_activations():
  from MaxLite.layers.mlp import MlpBlock

  x = jax.random.normal(jax.random.key(6), (4, 512, 64))

  def temp_bytes(chunks):
    config = make_config(*RUN, "base_emb_dim=64", "base_mlp_dim=1024", f"num_mlp_chunks={chunks}")
    block = MlpBlock(config)
    params = block.init(jax.random.key(0), x)
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(block.apply(p, x) ** 2), argnums=(0, 1)))
    return grad.lower(params, x).compile().memory_analysis().temp_size_in_bytes

  one_activation = 4 * 512 * 1024 * 4  # gate, up and their product are each this large, float32
  whole, chunked = temp_bytes(1), temp_bytes(8)
  assert whole >= 2 * one_activation and chunked < whole / 4


@pytest.mark.slow
def test_bfloat16_weight_gradients_of_mlp_parts_stay_near_the_whole_blocks():
  """Each device adds up its parts' weight gradients in the compute dtype (bfloat16 here) before the one
  reduce-scatter: 16 parts measured 1.25x the whole block's distance from the float32 gradient (0.0074 vs 0.0060)."""
  from MaxLite.layers.mlp import MlpBlock

  x = jax.random.normal(jax.random.key(6), (2, 1024, 256))

  def weight_grads(chunks, dtype):
    sizes = ("max_target_length=1024", "base_emb_dim=256", "base_mlp_dim=1024")
    config = make_config(*RUN, *sizes, f"num_mlp_chunks={chunks}", f"dtype={dtype}")
    block = MlpBlock(config)
    params = block.init(jax.random.key(0), x)
    return jax.tree.leaves(jax.grad(lambda p: jnp.sum(block.apply(p, x).astype(jnp.float32) ** 2))(params))

  def distance(got, exact):
    return max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(got, exact))

  exact = weight_grads(1, "float32")
  assert distance(weight_grads(16, "bfloat16"), exact) <= 1.5 * distance(weight_grads(1, "bfloat16"), exact)


def test_mlp_chunks_are_whole_unless_asked_for():
  assert make_config(*RUN).mlp_chunks == 1  # parts cost FSDP traffic per part: only on request
  assert make_config(*RUN, "num_mlp_chunks=4").mlp_chunks == 4


@pytest.mark.parametrize(
  "overrides, error",
  [
    (
      ("num_mlp_chunks=3",),
      r"num_mlp_chunks=3 must be a positive number that divides max_target_length=128",
    ),
    (("num_mlp_chunks=0",), r"num_mlp_chunks=0 must be a positive number"),
  ],
)
def test_bad_mlp_chunks_are_one_line(overrides, error):
  with pytest.raises(ConfigError, match=error):
    make_config(*RUN, *overrides)


def test_mlp_chunks_that_cannot_split_a_sequence_shard_are_one_line():
  with pytest.raises(ConfigError, match=r"divides max_target_length=128 / sequence parallelism 2"):
    make_config(*RUN, "num_mlp_chunks=128", "ici_sequence_parallelism=2", "ici_fsdp_parallelism=4", num_devices=8)


@pytest.mark.slow
@pytest.mark.parametrize(
  "layout",
  [("ici_fsdp_parallelism=8",), ("ici_fsdp_parallelism=2", "ici_sequence_parallelism=2", "ici_tensor_parallelism=2")],
  ids=["fsdp8", "fsdp2_sequence2_tensor2"],
)
def test_mlp_chunks_move_no_more_between_devices_than_the_whole_mlp(layout):
  """The weights are gathered and their gradients reduced once per layer, not once per part: the compiled step's
  collective bytes (loop trip counts included) stay the whole MLP's. Gathering per part (the first version) moved
  1.29x (fsdp8) and 1.09x as much here."""
  from MaxLite.aot import compile_step
  from MaxLite.config.choices import MESH_AXES
  from MaxLite.planning import hlo_costs

  def moved_bytes(chunks):
    config = make_config(*RUN, "remat_policy=full", f"num_mlp_chunks={chunks}", *layout, num_devices=8)
    text = compile_step.lower_train_step(config, first_devices(8))[0].compile().as_text()
    return hlo_costs.summary(hlo_costs.device_ops(text, MESH_AXES, config.mesh_shape))["collective_bytes"]

  whole, chunked = moved_bytes(1), moved_bytes(8)
  print(f"collective bytes per step: whole MLP {whole:.0f}, 8 parts {chunked:.0f}")
  assert whole > 0 and chunked <= 1.05 * whole, (whole, chunked)


def test_offloaded_state_lives_in_host_memory_and_the_step_moves_it(tmp_path):
  from MaxLite.models.transformer import Transformer
  from MaxLite.parallel import sharding
  from MaxLite.parallel.mesh import create_mesh
  from MaxLite.training.optimizer import create_optimizer
  from MaxLite.training.train_state import abstract_state, create_train_state
  from MaxLite.training.train_step import jit_train_step

  config = make_config(*RUN, "parameter_memory_host_offload=true", "optimizer_memory_host_offload=true")
  mesh = create_mesh(config, first_devices(1))
  with jax.set_mesh(mesh):
    model, tx = Transformer(config), create_optimizer(config)
    _, _, shardings = abstract_state(model, tx, config, mesh)
    shardings = sharding.with_host_offload(shardings, config)
    state = create_train_state(model, tx, config, shardings)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves((state.params, state.opt_state))}
    assert kinds == {"pinned_host"}
    step = jit_train_step(config, shardings, sharding.batch_sharding(mesh, config), sharding.replicated(mesh))
    batch = {k: jnp.ones((config.micro_batch_size, config.max_target_length), jnp.int32) for k in BATCH_KEYS}
    new_state, metrics = step(state, jax.device_put(batch, sharding.batch_sharding(mesh, config)))
  assert np.isfinite(float(metrics["loss"]))
  kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves((new_state.params, new_state.opt_state))}
  assert kinds == {"pinned_host"}  # back in host memory after the step


# A train step's dump as XLA writes it, cut down: 4 scanned layers with one weight each, split 4 ways (fsdp) on its
# second dim; Adam's first moment; a batch. At the peak (t=5): the weights, their moment, the weights cast and one
# layer's slice gathered, the stacked saved inputs, logits, attention scores, a weight gradient and an activation copied
# by XLA; the bigger logits of t=1-2 are dead by then.
_LIVE_RANGES = """HloLiveRange (max 9):
  InstructionSequence:
    0:param.0
  BufferLiveRange:
    param.0{}:0-9
    param.1{}:0-9
    param.2{}:0-3
    convert.1{}:1-6
    all-gather.1{}:2-6
    fusion.11{}:1-2
    while.5{}:3-7
    while.5{1}:3-7
    fusion.7{}:4-6
    fusion.8{}:5-5
    fusion.9{}:5-8
    fusion.10{}:4-4
    copy.3{}:5-6
    fusion.12{}:8-9
  Live ranges at 2 (peak):
    fusion.11{}: 1 bytes (cumulative: 1 bytes)
"""
_ASSIGNMENT = """allocation 0: size 16384, parameter 0, shape |f32[4,16,64]| at ShapeIndex {}:
 value: <1 param.0 @0> (size=16384,offset=0): f32[4,16,64]{2,1,0}
allocation 1: size 16384, parameter 1, shape |f32[4,16,64]| at ShapeIndex {}:
 value: <2 param.1 @0> (size=16384,offset=0): f32[4,16,64]{2,1,0}
 value: <3 fusion.12 @0> (size=16384,offset=0): f32[4,16,64]{2,1,0}
allocation 2: size 1024, parameter 2, shape |s32[2,128]| at ShapeIndex {}:
 value: <4 param.2 @0> (size=1024,offset=0): s32[2,128]{1,0}
allocation 3: size 4, thread-local:
 value: <5 add.99 @0> (size=4,offset=0): f32[]
allocation 4: size 9000000, preallocated-temp:
 value: <6 convert.1 @0> (size=8192,offset=0): bf16[4,16,64]{2,1,0}
 value: <7 all-gather.1 @0> (size=8192,offset=8192): bf16[64,64]{1,0}
 value: <8 fusion.11 @0> (size=1600000,offset=16384): f32[4,400,1000]{2,1,0}
 value: <9 while.5{} (phi) @0> (size=16,offset=16384): (s32[], bf16[4,2,128,64])
 value: <10 while.5{1} (phi) @0> (size=262144,offset=16400): bf16[4,2,128,64]{3,2,1,0:T(8,128)(2,1)}
 value: <11 fusion.7 @0> (size=1024000,offset=300000): f32[2,128,1000]{2,1,0}
 value: <12 fusion.8 @0> (size=524288,offset=1400000): f32[2,4,128,128]{3,2,1,0}
 value: <13 fusion.9 @0> (size=16384,offset=2000000): f32[4,16,64]{2,1,0}
 value: <14 fusion.10 @0> (size=65536,offset=2100000): f32[2,128,64]{2,1,0}
 value: <15 copy.3 @0> (size=65536,offset=2200000): f32[2,128,64]{2,1,0}
allocation 5: size 99999, color 1, preallocated-temp:
 value: <16 fusion.9 @0> (size=99999,offset=0): f32[4,16,64]{2,1,0}
"""
_HLO = """HloModule jit_split_train_step

%body (p: (s32[], bf16[4,2,128,64])) -> (s32[], bf16[4,2,128,64]) {
  %add.99 = f32[] add(%a, %b), metadata={op_name="jit(split_train_step)/jvp(Transformer)/decoder/while/body/add"}
}

ENTRY %main.1_spmd (param.0: f32[4,16,64], param.1: f32[4,16,64], param.2: s32[2,128]) -> (f32[4,16,64]) {
  %param.0 = f32[4,16,64]{2,1,0} parameter(0), sharding={devices=[1,4,1]<=[4]}, metadata={op_name="params[\\'decoder\\'][\\'layers\\'][\\'mlp\\'][\\'wi_0\\'][\\'kernel\\']"}
  %param.1 = f32[4,16,64]{2,1,0} parameter(1), sharding={devices=[1,4,1]<=[4]}, metadata={op_name="rest.opt_state[1][0].mu[\\'decoder\\'][\\'layers\\'][\\'mlp\\'][\\'wi_0\\'][\\'kernel\\']"}
  %param.2 = s32[2,128]{1,0} parameter(2), sharding={devices=[4,1]<=[4]}, metadata={op_name="batch[\\'inputs\\']"}
  %convert.1 = bf16[4,16,64]{2,1,0} convert(%param.0)
  %all-gather.1 = bf16[64,64]{1,0} all-gather(%ds.1), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, metadata={op_name="jit(split_train_step)/jvp(Transformer)/decoder/while/body/closed_call/layers/mlp/wi_0/dot_general" stack_frame_id=3}
  %fusion.11 = f32[4,400,1000]{2,1,0} fusion(%x), kind=kLoop, calls=%f11, metadata={op_name="jit(split_train_step)/jvp(Transformer)/logits_dense/dot_general"}
  %while.5 = (s32[], bf16[4,2,128,64]{3,2,1,0:T(8,128)(2,1)}) while(%tuple.4), condition=%cond, body=%body, metadata={op_name="jit(split_train_step)/jvp(Transformer)/decoder/while"}
  %fusion.7 = f32[2,128,1000]{2,1,0} fusion(%gte.1, %all-gather.1), kind=kOutput, calls=%f7, metadata={op_name="jit(split_train_step)/jvp(Transformer)/logits_dense/dot_general"}
  %fusion.8 = f32[2,4,128,128]{3,2,1,0} fusion(%gte.1), kind=kOutput, calls=%f8, metadata={op_name="jit(split_train_step)/transpose(jvp(Transformer))/decoder/while/body/closed_call/checkpoint/layers/self_attention/dot_general"}
  %fusion.9 = f32[4,16,64]{2,1,0} fusion(%fusion.8), kind=kLoop, calls=%f9, metadata={op_name="jit(split_train_step)/transpose(jvp(Transformer))/decoder/while"}
  %fusion.10 = f32[2,128,64]{2,1,0} fusion(%gte.1), kind=kLoop, calls=%f10, metadata={op_name="jit(split_train_step)/jvp(Transformer)/decoder_norm/mul"}
  %copy.3 = f32[2,128,64]{2,1,0} copy(%fusion.10)
  %fusion.12 = f32[4,16,64]{2,1,0} fusion(%param.1, %fusion.9), kind=kLoop, calls=%f12, metadata={op_name="jit(split_train_step)/add"}
  ROOT %tuple.1 = (f32[4,16,64]{2,1,0}) tuple(%fusion.12)
}
"""  # noqa: E501


def test_buffers_live_at_the_peak_are_named_by_role(tmp_path):
  for suffix, text in (
    ("after_optimizations-live-range.txt", _LIVE_RANGES),
    ("after_optimizations-buffer-assignment.txt", _ASSIGNMENT),
    ("after_optimizations.txt", _HLO),
  ):
    (tmp_path / f"module_0001.jit_split_train_step.{suffix}").write_text(text)
  wi_0 = "decoder/layers/mlp/wi_0/kernel"
  buffers = buffer_report.live_at_peak(str(tmp_path), buffer_report.Model(seq=128, vocab=(1000,)))
  assert [(b.size, b.role, b.what, b.shape) for b in buffers] == [
    (1024000, "logits", "logits (logits_dense/dot_general)", "f32[2,128,1000]"),
    (524288, "attention scores", "gradient (decoder/layers/self_attention/dot_general)", "f32[2,4,128,128]"),
    (
      262144,
      "saved activations",
      "kept by the 4 scanned layers for the backward pass (decoder/while)",
      "bf16[4,2,128,64]",
    ),
    (65536, "activations", "decoder_norm/mul (copy)", "f32[2,128,64]"),
    (16384, "gradients", wi_0, "f32[4,16,64]"),
    (16384, "optimizer state", f"mu of {wi_0}", "f32[4,16,64]"),
    (16384, "weights", wi_0, "f32[4,16,64]"),
    (8192, "weights, gathered or cast", wi_0, "bf16[64,64]"),
    (8192, "weights, gathered or cast", f"{wi_0}, bf16 convert", "bf16[4,16,64]"),
    (16, "other", "while.5's tuple (its elements' addresses)", "(s32[],"),
  ]
  roles = {role: (size, n) for role, size, n in buffer_report.by_role(buffers)}
  assert roles["weights, gathered or cast"] == (16384, 2) and "data batch" not in roles  # the batch died at t=3
  lines = buffer_report.format_report(buffers, count=3)
  assert lines[0] == "live at the memory peak, per device: 1.85 MiB in 10 buffers, by role:"
  assert lines[1].split() == ["logits", "1000.0", "KiB", "(1", "buffer)"]
  assert lines[-3:] == [
    "  1000.0 KiB  logits                     f32[2,128,1000]: logits (logits_dense/dot_general)",
    "   512.0 KiB  attention scores           f32[2,4,128,128]: gradient (decoder/layers/self_attention/dot_general)",
    "   256.0 KiB  saved activations          bf16[4,2,128,64]: kept by the 4 scanned layers for the backward pass "
    "(decoder/while)",
  ]
  assert buffer_report.live_at_peak(str(tmp_path / "missing"), buffer_report.Model(128, (1000,))) == []
  assert buffer_report.dump_dir_in("--xla_foo=1 --xla_dump_to=/a --xla_dump_to=/b/c") == "/b/c"
  assert buffer_report.dump_dir_in("--xla_force_host_platform_device_count=8") is None


def test_bfloat16_cast_equals_xla_convert_bit_for_bit_and_differentiates_like_it():
  from MaxLite.layers.linears import cast_weight

  w = jax.random.normal(jax.random.key(0), (100_000,)) * jnp.logspace(-40, 38, 100_000)
  w = jnp.concatenate([w, jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, -0.0, 3.4e38, 1e-45, 1.0000001])])
  nans = jax.lax.bitcast_convert_type(
    jnp.array([0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0xFFC00000], jnp.uint32), jnp.float32
  )
  w = jnp.concatenate([w, nans])
  as_bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)
  got, want = cast_weight(w, jnp.bfloat16), w.astype(jnp.bfloat16)
  np.testing.assert_array_equal(jnp.isnan(got), jnp.isnan(w))  # NaN payloads may differ; NaN stays NaN
  np.testing.assert_array_equal(as_bits(got)[~jnp.isnan(w)], as_bits(want)[~jnp.isnan(w)])
  x = jax.random.normal(jax.random.key(1), (8, 64)).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.key(2), (64, 32))
  loss = lambda cast: lambda w: jnp.sum(jnp.sin((x @ cast(w)).astype(jnp.float32)))
  np.testing.assert_array_equal(
    jax.grad(loss(lambda w: cast_weight(w, jnp.bfloat16)))(w), jax.grad(loss(lambda w: w.astype(jnp.bfloat16)))(w)
  )


_STACKED_BF16 = """
import json, re
import jax
from MaxLite import config as config_lib
from MaxLite.aot import compile_step
from MaxLite.config import validation
from MaxLite.parallel import sharding
from MaxLite.parallel import topologies
from MaxLite.models.transformer import Transformer
from MaxLite.parallel.mesh import create_mesh
from MaxLite.training.optimizer import create_optimizer
from MaxLite.training.train_state import abstract_state
target = topologies.parse("v5p-8")
compile_step.prepare_backend(target)
devices = compile_step.target_devices(target, 1)
raw = config_lib.load_raw(["configs/base.yml", "model_name=tiny", "dtype=bfloat16", "jax_cache_dir="])
config = config_lib.Config(validation.validate_and_derive(raw, num_devices=4, num_slices=1, process_count=1,
                                                       platform="tpu"))
text = compile_step.lower_train_step(config, devices)[0].compile().as_text()
mesh = create_mesh(config, devices)
with jax.set_mesh(mesh):
  abstract, _, shardings = abstract_state(Transformer(config), create_optimizer(config), config, mesh)
stacked = abstract.params["decoder"]["layers"], shardings.params["decoder"]["layers"]
layers = zip(*map(jax.tree.leaves, stacked))
shapes = {"bf16[" + ",".join(map(str, s.shard_shape(a.shape))) + "]" for a, s in layers if a.ndim > 2}
print(json.dumps({"stacked": sorted(shapes), "found": sorted(s for s in shapes if s in text)}))
"""


@pytest.mark.slow
@pytest.mark.skipif(topologies.find_libtpu(REPO) is None, reason="libtpu not installed (bash setup.sh)")
def test_tpu_step_keeps_no_bfloat16_copy_of_the_stacked_layer_weights():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
    [sys.executable, "-c", _STACKED_BF16], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert len(result["stacked"]) >= 4 and result["found"] == []
