"""LoRA through Qwix (enable_lora): only the adapters train and are saved, a run resumes bit for bit, SFT and DPO
with adapters learn, DPO's reference is the base with the adapters off, bad keys are one line."""

import math
import os
import re

import jax
import numpy as np
import pytest
from support.config import REPO, TINY, first_devices, make_config
from support.layouts import DENSE, loss_curves, train_layout
from support.resume import rerun_from_the_checkpoint_before_the_last

from MaxLite.checkpoint.manager import saved_arrays
from MaxLite.cli.errors import ConfigError
from MaxLite.training.trainer import train

pytest.importorskip("qwix")

COMMON = (
  *TINY,
  "per_device_batch_size=4",
  "learning_rate=3e-3",
  "warmup_steps_fraction=0.0",
)
LORA = ("enable_lora=true", "lora_rank=4", "lora_alpha=8")
POST = os.path.join(REPO, "assets", "post_training")
CHAT = (
  "tokenizer_type=huggingface",
  f"tokenizer_path={os.path.join(REPO, 'assets', 'tokenizer', 'chat')}",
  "use_chat_template=true",
  "dataset_type=grain",
  "grain_file_type=jsonl",
)


def _losses(rows):
  return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """A pretrained tiny model's step directory: the frozen base of the LoRA runs."""
  out = tmp_path_factory.mktemp("base")
  train(
    make_config(*COMMON, "dataset_type=synthetic", "steps=2", f"base_output_directory={out}", "run_name=pre"),
    first_devices(1),
  )
  return str(out / "pre" / "checkpoints" / "2")


def _lora_config(tmp_path, base, name, *extra):
  """6 steps of a LoRA run on the shipped data from `base`, with a checkpoint at step 3."""
  return make_config(
    *COMMON,
    *LORA,
    "dataset_type=grain",
    "eval_interval=-1",
    f"load_parameters_path={base}",
    f"base_output_directory={tmp_path}",
    f"run_name={name}",
    "steps=6",
    "checkpoint_period=3",
    *extra,
  )


@pytest.mark.slow
def test_only_the_adapters_train_are_saved_and_resume_bit_for_bit(tmp_path, base):
  config = _lora_config(tmp_path, base, "a")
  straight = train(config, first_devices(1))
  assert _losses(straight)[-1] < _losses(straight)[0]
  _replayed_from_the_previous_checkpoint(straight, config)
  # The checkpoint holds the adapters and their optimizer state, nothing of the base.
  names = saved_arrays(str(tmp_path / "a" / "checkpoints" / "6" / "state"))
  params = [n for n in names if n.startswith("params.")]
  assert params and all(re.search(r"kernel_lora_[ab]$", n) for n in params), params
  assert not any(n.startswith(("frozen.", "reference.")) for n in names)
  assert all(re.search(r"kernel_lora_[ab]$", n) for n in names if n.startswith("opt_state.") and "mu" in n)


@pytest.mark.slow
def test_the_base_never_changes_and_gets_no_gradient(tmp_path, base):
  """One step of the jitted train step: the adapters move, the frozen base comes back bit for bit."""

  config = make_config(
    *COMMON, *LORA, "dataset_type=synthetic", f"load_parameters_path={base}", "lora_module_path=.*wo"
  )
  before, after, metrics = _one_step(config, rows=4, seq=64)
  jax.tree.map(np.testing.assert_array_equal, after[0], before[0])
  # Only the MLP's down projections carry adapters (lora_module_path=.*wo); B starts at zero, and both move.
  assert {p[-2] for p in _paths(after[1])} == {"wo"}
  moved = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(after[1]), jax.tree.leaves(before[1]))]
  assert all(m > 0 for m in moved) and np.isfinite(float(metrics["loss"]))


def _paths(tree):
  from flax import traverse_util

  return list(traverse_util.flatten_dict(tree))


@pytest.mark.slow
def test_sft_with_lora_lowers_eval_loss_and_dpo_with_lora_starts_at_log_2_and_learns(tmp_path, base):
  common = (*COMMON, *CHAT, f"base_output_directory={tmp_path}", "max_target_length=256", "per_device_batch_size=2")
  sft_args = (
    *common,
    *LORA,
    f"load_parameters_path={base}",
    "use_sft=true",
    "sft_train_on_completion_only=true",
    f"grain_train_files={POST}/chats-train.jsonl",
    f"grain_eval_files={POST}/chats-eval.jsonl",
    "learning_rate_schedule_steps=20",
    "eval_interval=10",
    "eval_steps=2",
  )
  sft = train(make_config(*sft_args, "run_name=sft", "steps=20", "checkpoint_period=10"), first_devices(1))
  evals = [r["eval_loss"] for r in sft if "eval_loss" in r]
  print("SFT with LoRA, eval loss at steps 10 and 20:", evals)
  assert evals[-1] < evals[0]
  # Killed after step 20, before its save: resumed from step 10, steps 11-20 again, the same losses bit for bit.
  _replayed_from_the_previous_checkpoint(
    sft, make_config(*sft_args, "run_name=sft", "steps=20", "checkpoint_period=10")
  )
  pairs = tmp_path / "pairs.jsonl"  # the first 4 shipped pairs, learnt and evaluated
  with open(f"{POST}/preferences-train.jsonl") as f:
    pairs.write_text("".join(f.readline() for _ in range(4)))
  dpo_args = (
    *common,
    *LORA,
    "use_dpo=true",
    "learning_rate=1e-2",
    "learning_rate_schedule_steps=16",
    f"load_parameters_path={tmp_path}/sft/checkpoints/20",  # a LoRA step: the base with its adapters merged
    f"grain_train_files={pairs}",
    f"grain_eval_files={pairs}",
    "eval_interval=16",
    "eval_steps=2",
  )
  dpo = train(make_config(*dpo_args, "run_name=dpo", "steps=16", "checkpoint_period=8"), first_devices(1))
  np.testing.assert_allclose(dpo[0]["loss"], math.log(2), rtol=1e-6)  # adapters at zero: the policy is the reference
  # Resumed from step 8: the same losses bit for bit (the reference, a merged LoRA step, is read again).
  _replayed_from_the_previous_checkpoint(dpo, make_config(*dpo_args, "run_name=dpo", "steps=16", "checkpoint_period=8"))
  (final,) = [r for r in dpo if "eval_loss" in r]
  print("DPO with LoRA after 16 steps on 4 shipped pairs:", final)  # at step 0 every reward is 0: accuracy 0
  assert final["eval_rewards/accuracies"] > 0.5 and final["eval_loss"] < math.log(2)


def _replayed_from_the_previous_checkpoint(rows, config):
  """The run that logged `rows`, its last checkpoint removed and run again (support.resume): the steps it runs again
  have the same losses, bit for bit."""
  again = rerun_from_the_checkpoint_before_the_last(config)
  assert _losses(again) == _losses(rows)[-len(_losses(again)) :]


@pytest.fixture(scope="module")
def trained_start(tmp_path_factory):
  """(base step, adapters step) of the 8-head tiny model: every layout starts from both, so they begin equal whatever
  each run's own fresh init would be (Qwix draws A inside the layer, where remat changes the random stream)."""
  out = tmp_path_factory.mktemp("start")
  common = (*COMMON, *DENSE, "dataset_type=synthetic", "steps=2", f"base_output_directory={out}")
  train(make_config(*common, "run_name=base"), first_devices(1))
  base = f"{out}/base/checkpoints/2"
  train(make_config(*common, *LORA, "run_name=lora", f"load_parameters_path={base}"), first_devices(1))
  return base, f"{out}/lora/checkpoints/2"


@pytest.fixture(scope="module")
def one_device_lora(tmp_path_factory, trained_start):
  start = (f"load_parameters_path={trained_start[0]}", f"lora_restore_path={trained_start[1]}")
  return loss_curves(train_layout(tmp_path_factory.mktemp("one"), 1, *DENSE, *LORA, *start, "per_device_batch_size=8"))


@pytest.mark.slow
@pytest.mark.parametrize(
  "mesh",
  [
    # The adapters split over tensor and fsdp, sequence shards, a remat policy and the head in vocab tiles.
    (
      *("ici_sequence_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
      *("remat_policy=minimal", "num_vocab_tiling=2"),
    ),
    # The pipeline applies each layer by itself (the adapters' module paths without decoder/layers/), no remat.
    ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "remat_policy=none"),
  ],
  ids=["sequence2_fsdp2_tensor2_minimal_vocab_tiling2", "stage2_fsdp4_none"],
)
def test_lora_layouts_and_remat_policies_train_like_one_device(tmp_path, trained_start, one_device_lora, mesh):
  start = (f"load_parameters_path={trained_start[0]}", f"lora_restore_path={trained_start[1]}")
  losses, grad_norms = loss_curves(train_layout(tmp_path, 8, *DENSE, *LORA, *start, "per_device_batch_size=1", *mesh))
  np.testing.assert_allclose(losses, one_device_lora[0], rtol=1e-5)
  np.testing.assert_allclose(grad_norms, one_device_lora[1], rtol=1e-5)


@pytest.mark.parametrize(
  "overrides, fragment",
  [
    (("enable_lora=true", "lora_rank=0"), "lora_rank must be a positive integer with enable_lora=true, got 0"),
    (("enable_lora=true", "lora_weight_qtype=nf3"), "lora_weight_qtype='nf3' is not one of: '', 'nf4', 'int8'"),
    (("lora_restore_path=somewhere",), "lora_restore_path is set but enable_lora=false"),
    (("enable_lora=true", "lora_module_path=(("), "lora_module_path='((' is not a regular expression"),
    (("enable_lora=true", "quantization=int8", "use_qwix_quantization=true"), "enable_lora=true with quantization"),
  ],
)
def test_bad_lora_settings_are_one_line(overrides, fragment):
  with pytest.raises(ConfigError, match=re.escape(fragment)) as caught:
    make_config(*overrides)
  assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
  "model, path, fragment",
  [
    ("tiny", "decoder/nothing/here", "lora_module_path='decoder/nothing/here' matches no projection"),
    ("tiny-moe", ".*(moe|self_attention).*", "puts adapters on the routed experts (decoder/layers/moe/gate)"),
    ("tiny-deepseek", "decoder/moe_layers/.*", "puts adapters on the routed experts (decoder/moe_layers/moe/gate)"),
  ],
)
def test_a_module_path_that_matches_nothing_or_routed_experts_is_one_line(model, path, fragment):
  from MaxLite.parallel.mesh import create_mesh
  from MaxLite.training import builder

  config = make_config(f"model_name={model}", "max_target_length=32", *LORA, f"lora_module_path={path}")
  with pytest.raises(ConfigError, match=re.escape(fragment)) as caught:
    builder.training(config, create_mesh(config, first_devices(1)))
  assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_deepseek_lora_adapts_attention_and_shared_experts_and_a_step_keeps_the_frozen_routing_bias(capsys):
  """DeepSeek's MoE layers live under decoder/moe_layers: the default lora_module_path adapts their attention and
  shared experts (a path containing "moe" is not a routed expert; only the MoE block's own modules are). One step
  with routed_bias_update_rate > 0 (tiny-deepseek's 0.001) trains the adapters and returns the whole base, routing
  bias included, bit for bit: the bias is part of the frozen base, which a LoRA checkpoint does not hold."""

  config = make_config(
    *COMMON,
    "model_name=tiny-deepseek",
    "max_target_length=32",
    "per_device_batch_size=2",
    "dataset_type=synthetic",
    *LORA,
  )
  assert config.routed_bias_update_rate > 0
  before, after, metrics = _one_step(config, rows=2, seq=32)
  from MaxLite.layers import lora

  modules = lora.adapted_modules(after[1])
  for module in ("moe_layers/self_attention/wq_b", "moe_layers/shared_experts/wo", "dense_layers/mlp/wi_0"):
    assert f"decoder/{module}" in modules, modules
  assert not [m for m in modules if "/moe/" in f"{m}/"]
  jax.tree.map(np.testing.assert_array_equal, after[0], before[0])
  assert "score_correction_bias" in after[0]["decoder"]["moe_layers"]["moe"]
  moved = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(after[1]), jax.tree.leaves(before[1]))]
  assert all(m > 0 for m in moved) and np.isfinite(float(metrics["loss"]))
  assert (
    "the base is frozen, its routing bias too (routed_bias_update_rate is for full training)" in capsys.readouterr().out
  )


QLORA = ("lora_weight_qtype=nf4", "lora_tile_size=16")


@pytest.mark.parametrize(
  "model, overrides, fragment",
  [
    (
      "tiny",
      ("lora_tile_size=64",),
      "lora_tile_size=64 must divide head_dim=16, the dimension decoder/layers/self_attention/out contracts",
    ),
    (
      "tiny",
      ("lora_tile_size=128", "scan_layers=false", "lora_module_path=decoder/layers_1/mlp/wo"),
      "lora_tile_size=128 must divide base_mlp_dim=192, the dimension decoder/layers_1/mlp/wo contracts",
    ),
    (
      "tiny-deepseek",
      ("lora_tile_size=32", "lora_module_path=.*wkv_b"),
      "lora_tile_size=32 must divide kv_lora_rank=16, the dimension decoder/dense_layers/self_attention/wkv_b",
    ),
    (
      "tiny-deepseek",
      ("lora_tile_size=32", "lora_module_path=decoder/moe_layers/shared_experts/.*"),
      "must divide shared_experts x moe_mlp_dim=48, the dimension decoder/moe_layers/shared_experts/wo contracts",
    ),
  ],
)
def test_a_qlora_tile_that_does_not_divide_a_contracted_dimension_is_one_line(model, overrides, fragment):
  with pytest.raises(ConfigError, match=re.escape(fragment)) as caught:
    make_config(f"model_name={model}", "max_target_length=32", *LORA, "lora_weight_qtype=nf4", *overrides)
  assert "\n" not in str(caught.value)


def test_a_qlora_tile_is_checked_only_against_the_adapted_projections():
  """Tiles of 64 divide the MLP inputs' base_emb_dim=64, not the attention output's head_dim=16: adapting the former
  alone is a valid QLoRA model, and it builds."""
  from MaxLite.parallel.mesh import create_mesh
  from MaxLite.training import builder

  config = make_config(*COMMON, *LORA, "lora_weight_qtype=nf4", "lora_tile_size=64", "lora_module_path=.*mlp/wi_.")
  builder.training(config, create_mesh(config, first_devices(1)))


@pytest.mark.parametrize(
  "model, overrides",
  [
    ("tiny", ()),
    ("tiny", ("scan_layers=false", "fused_qkv=true", "fused_mlp=true", "base_num_kv_heads=4")),
    ("tiny-moe", ()),
    ("tiny-gemma3", ()),
    ("tiny-deepseek", ()),
    ("tiny-deepseek", ("q_lora_rank=0", "scan_layers=false", "shared_experts=2")),
  ],
)
def test_the_qlora_tile_check_knows_each_projection_s_contracted_dimension(model, overrides):
  """The config-time table (config/validation.py) against the model: every kernel Qwix can adapt, and the innermost
  dimension its matmul contracts (A [in, rank] flattens the contracted dims, the leading ones of the kernel)."""
  from flax import traverse_util

  from MaxLite.config.validation import qlora_contractions
  from MaxLite.models import build

  config = make_config(
    f"model_name={model}", "max_target_length=32", *LORA, "lora_module_path=(decoder|logits).*", *overrides
  )
  flat = traverse_util.flatten_dict(build.abstract_parameters(config))
  model_dims = {}
  for path, a in flat.items():
    if path[-1] == "kernel_lora_a" and "moe" not in path:  # the router: refused by name, never quantized
      stacked = config.scan_layers and path[0] == "decoder"  # a scanned stack's leading layers axis
      kernel = flat[(*path[:-1], "kernel")].shape[int(stacked) :]
      contracted = next(k for k in range(1, len(kernel) + 1) if math.prod(kernel[:k]) == a.shape[-2])
      model_dims["/".join(path[:-1])] = kernel[contracted - 1]
  assert model_dims == {path: size for path, _, size in qlora_contractions(config.to_dict())}


@pytest.mark.slow
def test_qlora_multiplies_by_the_quantized_base_and_resumes_bit_for_bit(tmp_path, base):
  """QLoRA (nf4, tiles of 16): the base is stored as Qwix's nf4 (4 bits a weight plus a scale per tile) and the model
  computes with it: with the adapters at zero its logits are the plain model's on the quantize-dequantized kernels,
  not on the float ones. A QLoRA run stopped and resumed gives the uninterrupted losses bit for bit."""
  from flax import traverse_util
  from flax.linen import partitioning as nn_partitioning
  from qwix._src.core import qarray

  from MaxLite.checkpoint import lora_steps
  from MaxLite.models import build
  from MaxLite.parallel import sharding as sharding_lib
  from MaxLite.parallel.mesh import create_mesh
  from MaxLite.training import builder
  from MaxLite.training.train_state import model_params
  from MaxLite.training.trainer import initial_state

  config = make_config(*COMMON, *LORA, *QLORA, "dataset_type=synthetic", f"load_parameters_path={base}")
  mesh = create_mesh(config, first_devices(1))
  ids = np.random.default_rng(0).integers(1, 8192, (2, 64)).astype(np.int32)
  pos = np.broadcast_to(np.arange(64, dtype=np.int32), ids.shape)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    pieces = builder.training(config, mesh)
    state, _ = initial_state(config, pieces)
    ours = np.asarray(pieces.model.apply({"params": model_params(state)}, ids, pos, np.ones_like(ids)))
    plain = build.parameters(config, mesh, stored=False)
    floats = lora_steps.load_params(
      base,
      jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), plain.abstract, plain.shardings),
    )
  frozen = traverse_util.flatten_dict(state.frozen)
  kernels = {k: v for k, v in frozen.items() if hasattr(v, "array")}
  assert len(kernels) == 7 and all(v.array.qvalue.dtype == jax.numpy.uint4 for v in kernels.values())
  restored = traverse_util.flatten_dict(jax.tree.map(np.asarray, floats))
  for k, v in kernels.items():
    restored[k] = np.asarray(jax.vmap(qarray.dequantize)(v.array))
  dequantized = traverse_util.unflatten_dict(restored)
  model = build.model(config, stored=False)
  want = np.asarray(model.apply({"params": dequantized}, ids, pos, np.ones_like(ids)))
  unquantized = np.asarray(model.apply({"params": floats}, ids, pos, np.ones_like(ids)))
  print(
    f"QLoRA vs dequantized base {np.abs(ours - want).max():.2e}, vs float base {np.abs(ours - unquantized).max():.2e}"
  )
  assert np.abs(ours - want).max() < 1e-4 < 1e-2 < np.abs(ours - unquantized).max()
  qlora = _lora_config(tmp_path, base, "q", *QLORA)
  _replayed_from_the_previous_checkpoint(train(qlora, first_devices(1)), qlora)
  # DPO over a QLoRA base: the reference is that quantized base with the adapters off, so the first loss is log 2.
  dpo = train(
    make_config(
      *COMMON,
      *CHAT,
      *LORA,
      *QLORA,
      "use_dpo=true",
      f"load_parameters_path={base}",
      "steps=1",
      "max_target_length=256",
      f"grain_train_files={POST}/preferences-train.jsonl",
      "grain_eval_files=",
      f"base_output_directory={tmp_path}",
      "run_name=qdpo",
    ),
    first_devices(1),
  )
  # float32 rounding of two forward passes (1.1e-6 with the tests' compile flags); a reference that used the
  # unquantized base would be off by the quantization error, orders of magnitude more
  np.testing.assert_allclose(dpo[0]["loss"], math.log(2), rtol=1e-5)


def _one_step(config, rows: int, seq: int) -> tuple:
  """One LoRA train step from the config's start on one device: ((frozen, params) before, the same after, metrics)."""
  from flax.linen import partitioning as nn_partitioning

  from MaxLite.data import BATCH_KEYS
  from MaxLite.parallel import sharding as sharding_lib
  from MaxLite.parallel.mesh import create_mesh
  from MaxLite.training import builder
  from MaxLite.training.trainer import initial_state

  mesh = create_mesh(config, first_devices(1))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    pieces = builder.training(config, mesh)
    state, _ = initial_state(config, pieces)
    before = jax.tree.map(np.asarray, (state.frozen, state.params))
    ids = np.random.default_rng(0).integers(1, 8192, (rows, seq)).astype(np.int32)
    batch = {k: ids if "segmentation" not in k and "position" not in k else np.ones_like(ids) for k in BATCH_KEYS}
    batch["inputs_position"] = np.broadcast_to(np.arange(seq, dtype=np.int32), ids.shape).copy()
    new, metrics = pieces.step(state, batch)
    return before, jax.tree.map(np.asarray, (new.frozen, new.params)), metrics
