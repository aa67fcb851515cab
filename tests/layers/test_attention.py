"""Attention implementations: splash (Pallas kernel, interpreted on CPU) equals dot_product; which kernel a config
gets (the cuDNN path's own tests: test_cudnn_attention.py)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import partitioning as nn_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.config import REPO, derived_keys, first_devices, make_config

from MaxLite.cli.errors import ConfigError
from MaxLite.layers.attention import attention_mask, dot_product_attention
from MaxLite.layers.splash import splash_attention
from MaxLite.parallel import sharding, topologies
from MaxLite.parallel.mesh import create_mesh
from MaxLite.training.trainer import train

SEQ = 256
# float32 on CPU: the kernel's blockwise softmax differs from one softmax by rounding only.
FWD_ATOL, GRAD_ATOL = 2e-5, 1e-4


def _packed_segments(batch: int) -> jax.Array:
  """Rows with 3, 2 and 1 documents and trailing padding (segment 0), as the packer makes them."""
  rows = [
    [1] * 70 + [2] * 100 + [3] * 60 + [0] * 26,
    [1] * 200 + [2] * 56,
    [1] * 250 + [0] * 6,
    [1] * 10 + [2] * 118 + [3] * 128,
  ]
  return jnp.asarray((rows * batch)[:batch], jnp.int32)


def _qkv(batch: int, heads: int, kv_heads: int, head_dim: int = 64):
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (batch, SEQ, heads, head_dim)) * head_dim**-0.5
  k = jax.random.normal(keys[1], (batch, SEQ, kv_heads, head_dim))
  v = jax.random.normal(keys[2], (batch, SEQ, kv_heads, head_dim))
  return q, k, v


def _loss_and_grads(attend, q, k, v, segments):
  # sin() weights every output differently, so a wrong element anywhere changes some gradient.
  real = (segments != 0)[:, :, None, None]
  loss = lambda q, k, v: jnp.sum(jnp.where(real, jnp.sin(attend(q, k, v, segments)), 0.0))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _reference(q, k, v, segments):
  return dot_product_attention(q, k, v, attention_mask(segments))


def _assert_same(got, want):
  (loss, grads), (ref_loss, ref_grads) = got, want
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=GRAD_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize(
  "heads, kv_heads, fused",
  [(4, 4, "false"), (8, 2, "false"), (4, 1, "false"), (8, 2, "true")],
  ids=["mha", "gqa", "mqa", "gqa_fused_backward"],
)
def test_splash_forward_and_gradients_equal_dot_product_on_packed_rows(heads, kv_heads, fused):
  config = make_config(
    "model_name=tiny", f"max_target_length={SEQ}", "attention=splash", f"sa_use_fused_bwd_kernel={fused}"
  )
  q, k, v = _qkv(4, heads, kv_heads)
  segments = _packed_segments(4)
  splash = lambda q, k, v, s: splash_attention(q, k, v, s, config, interpret=True)
  real = (segments != 0)[:, :, None, None]
  np.testing.assert_allclose(
    jnp.where(real, splash(q, k, v, segments), 0), jnp.where(real, _reference(q, k, v, segments), 0), atol=FWD_ATOL
  )
  _assert_same(_loss_and_grads(splash, q, k, v, segments), _loss_and_grads(_reference, q, k, v, segments))


@pytest.mark.slow
@pytest.mark.parametrize("window", [1, 40, 128])
def test_windowed_splash_equals_the_windowed_dot_product_mask(window):
  """Gemma 3's local layers: the kernel's band (q - window < k <= q) is the dot-product path's mask, across blocks
  (window 40 < the 128-token blocks, 128 = a block), and the soft cap is applied alike."""
  config = make_config("model_name=tiny", f"max_target_length={SEQ}", "attention=splash")
  q, k, v = _qkv(2, 4, 2, head_dim=16)
  segments = _packed_segments(2)
  splash = lambda q, k, v, s: splash_attention(q, k, v, s, config, interpret=True, window=window, cap=5.0)
  reference = lambda q, k, v, s: dot_product_attention(q, k, v, attention_mask(s, window), cap=5.0)
  _assert_same(_loss_and_grads(splash, q, k, v, segments), _loss_and_grads(reference, q, k, v, segments))
  # The window is not the causal mask: without it the result differs.
  causal = lambda q, k, v, s: dot_product_attention(q, k, v, attention_mask(s), cap=5.0)
  assert not np.allclose(
    _loss_and_grads(causal, q, k, v, segments)[0], _loss_and_grads(reference, q, k, v, segments)[0]
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "mesh, kv_heads",
  [
    (("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"), 2),
    (("ici_fsdp_parallelism=2", "ici_sequence_parallelism=2", "ici_tensor_parallelism=2"), 2),
    (("ici_fsdp_parallelism=4", "ici_sequence_parallelism=2"), 1),
  ],
  ids=["fsdp4_tensor2", "fsdp2_sequence2_tensor2", "mqa_fsdp4_sequence2"],
)
def test_splash_under_shard_map_equals_dot_product_on_8_devices(mesh, kv_heads):
  config = make_config(
    "model_name=tiny",
    f"max_target_length={SEQ}",
    "attention=splash",
    "base_num_query_heads=8",
    f"base_num_kv_heads={kv_heads}",
    "per_device_batch_size=0.5",
    *mesh,
    num_devices=8,
  )
  device_mesh = create_mesh(config, first_devices(8))
  q, k, v = _qkv(4, 8, kv_heads)
  segments = _packed_segments(4)
  with jax.set_mesh(device_mesh), nn_partitioning.axis_rules(sharding.axis_rules(config)):
    layout = nn_partitioning.logical_to_mesh_axes(("activation_batch", "activation_length", "activation_heads", None))
    q = jax.device_put(q, NamedSharding(device_mesh, P(*layout)))
    splash = lambda q, k, v, s: splash_attention(q, k, v, s, config, interpret=True)
    got = _loss_and_grads(splash, q, k, v, segments)
  _assert_same(got, _loss_and_grads(_reference, q, k, v, segments))


@pytest.mark.slow
@pytest.mark.parametrize(
  "model, layout",
  [
    ("tiny", ()),
    ("tiny-moe", ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2")),  # batch split over fsdp x expert
  ],
  ids=["dense_1_device", "moe_expert4_fsdp2"],
)
def test_training_with_splash_gives_the_dot_product_losses(tmp_path, model, layout):
  def losses(num_devices, *overrides):
    config = make_config(
      f"model_name={model}",
      "max_target_length=128",  # one splash block either way (blocks are capped at the row); interpreting it is slow
      "steps=2",  # the second step's loss is of the first step's update: forward and backward both compared
      "dataset_type=synthetic",
      "eval_interval=-1",  # the last step's eval: not what these tests compare
      "enable_tensorboard=false",
      "enable_checkpointing=false",
      "learning_rate=1e-2",
      "warmup_steps_fraction=0.0",
      f"base_output_directory={tmp_path}",
      f"per_device_batch_size={8 // num_devices}",
      *overrides,
      num_devices=num_devices,
    )
    rows = train(config, first_devices(num_devices))
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]

  devices = 8 if layout else 1
  splash = losses(devices, "attention=splash", "run_name=splash", *layout)
  np.testing.assert_allclose(splash, losses(1, "attention=dot_product", "run_name=dense"), rtol=1e-5)


def test_splash_heads_must_split_over_the_rules_head_shards():
  rules = (
    '[["activation_batch", ["fsdp"]], ["activation_heads", ["tensor", "data"]], ["activation_kv_heads", ["tensor"]],'
    ' ["activation_length", ["sequence"]], ["embed", ["fsdp"]], ["vocab", ["tensor"]], ["layers", ["stage"]]]'
  )
  layout = ("ici_data_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=1")
  with pytest.raises(ConfigError, match=r"base_num_kv_heads=2 does not split over the 4 shards"):
    derived_keys("attention=splash", f"logical_axis_rules={rules}", *layout, num_devices=4)


def test_autoselected_on_tpu_applies_the_head_split_check_and_says_why_it_falls_back():
  rules = (
    '[["activation_batch", ["fsdp"]], ["activation_heads", ["tensor", "data"]], ["activation_kv_heads", ["tensor"]],'
    ' ["activation_length", ["sequence"]], ["embed", ["fsdp"]], ["vocab", ["tensor"]], ["layers", ["stage"]]]'
  )
  layout = ("ici_data_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=1")
  c = derived_keys(f"logical_axis_rules={rules}", *layout, platform="tpu", num_devices=4)
  assert c["attention_kernel"] == "dot_product"
  assert "not splash, because base_num_kv_heads=2 does not split over the 4 shards" in c["attention_choice"]
  assert derived_keys("max_target_length=64", platform="tpu")["attention_choice"].startswith(
    "autoselected: dot_product, not splash, because attention=splash needs max_target_length"
  )
  assert derived_keys(platform="tpu")["attention_choice"] == "autoselected: the splash kernel on TPU"


def test_autoselected_picks_by_platform_and_never_an_untileable_kernel():
  assert derived_keys()["attention_kernel"] == "dot_product"
  tpu = derived_keys(platform="tpu")
  assert (tpu["attention_kernel"], tpu["attention_interpret"]) == ("splash", False)
  assert derived_keys(platform="gpu")["attention_kernel"] == "dot_product"  # float32: cuDNN takes bfloat16 only
  assert derived_keys("dtype=bfloat16", platform="gpu")["attention_kernel"] == "cudnn"
  assert derived_keys("dtype=bfloat16", "ici_sequence_parallelism=2", platform="gpu", num_devices=2)[
    "attention_kernel"
  ] == ("dot_product")
  assert derived_keys("max_target_length=64", platform="tpu")["attention_kernel"] == "dot_product"
  assert derived_keys("attention=flash")["attention_kernel"] == "splash"  # MaxText's name, interpreted on CPU
  assert derived_keys("attention=flash")["attention_interpret"]
  # The fused backward kernel has no dq pass, so its block sizes do not matter.
  assert (
    derived_keys("attention=splash", "sa_use_fused_bwd_kernel=true", "sa_block_q_dq=100")["attention_kernel"]
    == "splash"
  )


def test_autoselected_checks_the_kernel_that_runs_against_what_the_config_needs():
  """Each family on a GPU in bf16: cudnn where it computes everything the config asks for, else dot_product with the
  missing capability named; an explicit cudnn that cannot compute the config is one line naming it."""
  gpu = lambda *o, **k: derived_keys("dtype=bfloat16", *o, platform="gpu", **k)  # noqa: E731
  for model in ("tiny", "tiny-gemma3", "tiny-deepseek", "tiny-moe"):
    c = gpu(f"model_name={model}")
    assert (c["attention_kernel"], c["attention_choice"]) == ("cudnn", "autoselected: cuDNN flash attention on GPU")
    assert (c["max_segments_per_seq"], c["attention_segments"]) == (32, 32)  # the packer keeps cuDNN's count
  capped = gpu("attn_logits_soft_cap=50.0")
  assert capped["attention_kernel"] == "dot_product"
  assert capped["attention_choice"] == (
    "autoselected: dot_product, not cudnn, because it does not compute a soft cap on the scores, which "
    "attn_logits_soft_cap=50.0 asks for"
  )
  with pytest.raises(ConfigError, match=r"^attention=cudnn_flash_jax does not compute a soft cap on the scores"):
    gpu("attention=cudnn_flash_jax", "attn_logits_soft_cap=50.0")
  assert gpu("max_segments_per_seq=8")["attention_segments"] == 8
  synthetic = gpu("dataset_type=synthetic")
  assert (synthetic["max_segments_per_seq"], synthetic["attention_segments"]) == (-1, 1)
  on_cpu = derived_keys()
  assert (on_cpu["max_segments_per_seq"], on_cpu["attention_segments"]) == (-1, 0)
  message = r"^max_segments_per_seq=1 must be -1 \(no cap\) or >= 2 \(dpo packs the 2 documents of a pair"
  with pytest.raises(ConfigError, match=message):
    derived_keys("max_segments_per_seq=1", "use_dpo=true", "load_parameters_path=/nowhere")


def test_pre_hopper_gpus_get_dot_product_for_packed_rows():
  from MaxLite.config.attention_choice import choose_attention

  raw = config_lib_raw("dtype=bfloat16")
  raw["max_segments_per_seq"] = 32
  kernel, why = choose_attention(raw, "gpu", 1, 1, gpu_capability="8.0")
  assert kernel == "dot_product"
  assert why.endswith(
    "because it packs segments only on Hopper or newer GPUs (compute capability 9.0); this GPU's is 8.0"
  )
  assert choose_attention(raw, "gpu", 1, 1, gpu_capability="9.0")[0] == "cudnn"
  assert choose_attention({**raw, "dataset_type": "synthetic"}, "gpu", 1, 1, gpu_capability="8.0")[0] == "cudnn"


def config_lib_raw(*overrides):
  from MaxLite import config as config_lib

  return config_lib.load_raw([os.path.join(REPO, "configs", "base.yml"), "model_name=tiny", *overrides])


@pytest.mark.parametrize(
  "overrides, fragment",
  [
    (("attention=splash", "max_target_length=64"), "attention=splash needs max_target_length / sequence"),
    (("attention=splash", "sa_block_q=100"), "sa_block_q=100 cannot tile the query length per shard 256"),
    (("attention=splash", "max_target_length=1024", "sa_block_kv_compute=384"), "sa_block_kv_compute=384 cannot"),
    (("attention=splash", "max_target_length=1024", "sa_block_kv=256"), "sa_block_kv_compute must divide sa_block_kv"),
    (("attention=cudnn",), "attention=cudnn needs an NVIDIA GPU (cuDNN flash attention); this run's devices are cpu"),
    (("attention=fast",), "attention='fast' is not one of"),
    (
      ("attention=cudnn", "dtype=float32"),
      "attention=cudnn does not compute float32 activations, which dtype=float32 asks for: use attention=dot_product",
    ),
    (
      ("attention=splash",),
      "attention=splash is a TPU kernel (interpreted on CPU for tests); this run's devices are gpu",
    ),
  ],
)
def test_unsupported_attention_settings_stop_with_one_line(overrides, fragment):
  with pytest.raises(ConfigError) as error:
    derived_keys(*overrides, platform="gpu" if "gpu" in fragment or "float32 activations" in fragment else "cpu")
  assert fragment in str(error.value) and "\n" not in str(error.value)


_NO_SCORES = """
import sys
from MaxLite import config as config_lib
from MaxLite.aot import compile_step
from MaxLite.config import validation
from MaxLite.parallel import topologies
target = topologies.parse(sys.argv[1])
compile_step.prepare_backend(target)
devices = compile_step.target_devices(target, 1)
for attention in sys.argv[2].split(","):
  raw = config_lib.load_raw([*sys.argv[3:], f"attention={attention}"])
  config = config_lib.Config(validation.validate_and_derive(raw, num_devices=4, num_slices=1, process_count=1,
                                                         platform="tpu"))
  compiled = compile_step.lower_train_step(config, devices)[0].compile()
  text = compiled.as_text()
  print("SCORES" if ",512,512]" in text else "NO_SCORES", config.attention_kernel)
  if config.attention_kernel == "splash":  # plan.py's reading of the same program: kernels costed by their blocks
    from unittest import mock
    from MaxLite.models import flops
    from MaxLite.planning import hlo_costs, perf_model, search
    planned = perf_model.planning_target(sys.argv[1], -1)
    costed = search.assess(config, planned, compiled, None, 0.0)["matmul_flops_ratio"]
    with mock.patch.object(hlo_costs, "splash_kernel_flops", lambda *args: 0.0):
      uncosted = search.assess(config, planned, compiled, None, 0.0)["matmul_flops_ratio"]
    counted = flops.training_flops_per_step(config)
    print("KERNELS", (costed - uncosted) * counted["total"] / counted["attention"])
"""


@pytest.mark.slow
@pytest.mark.skipif(topologies.find_libtpu(REPO) is None, reason="libtpu not installed (bash setup.sh)")
@pytest.mark.parametrize(
  "topology, attentions, expected",
  [
    # One process per chip family (libtpu reads its flags once, at start): both kernels on v5e in one.
    ("v5e-4", "splash,dot_product", ["NO_SCORES splash", "SCORES dot_product"]),
    ("v6e-4", "splash", ["NO_SCORES splash"]),
  ],
)
def test_splash_compiled_for_tpu_holds_no_seq_by_seq_scores(topology, attentions, expected):
  args = [
    topology,
    attentions,
    "configs/base.yml",
    "model_name=tiny",
    "max_target_length=512",  # scores would be [..., 512, 512]; splash tiles them 2 x 2 with 256-token blocks
    *(f"sa_block_{name}=256" for name in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute")),
    "jax_cache_dir=",
  ]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
    [sys.executable, "-c", _NO_SCORES, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  verdicts = [line for line in proc.stdout.splitlines() if "SCORES" in line]
  assert verdicts == expected
  # The kernels' FLOPs as plan.py costs them (they carry no cost of their own), over the model's causal attention
  # FLOPs: the forward (twice: the layer's remat), dq and dkv kernels each compute at least the causal half of the
  # 512-token mask (6.0x the model's count on v6e-4, 2026-12-07).
  (kernels,) = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("KERNELS")]
  assert 1.0 < kernels < 10.0, proc.stdout
