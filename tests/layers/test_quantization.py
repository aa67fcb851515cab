"""Quantized training through Qwix (quantization=int8|fp8|fp8_full): a projection's output and gradients are Qwix's
own quantized dot_general on the same arrays; the attention scores and the head stay unquantized; training with int8
follows the unquantized run closely but not exactly; the checkpoint stays full precision; bad keys are one line. int8
on 8 devices (one device's int8 matmuls, its first loss) is a row of tests/parallel/test_feature_layouts.py."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.config import REPO, first_devices, make_config
from support.resume import rerun_from_the_checkpoint_before_the_last

from MaxLite.cli.errors import ConfigError
from MaxLite.layers.linears import DenseGeneral
from MaxLite.layers.quantization import quantized
from MaxLite.parallel import topologies
from MaxLite.training.trainer import train

qwix_core = pytest.importorskip("qwix._src.core.dot_general_qt")

INT8 = ("quantization=int8", "use_qwix_quantization=true")


class _Projection(nn.Module):
  """A DenseGeneral at the path of a layer's MLP gate projection (decoder/layers/mlp/wi_0)."""

  @nn.compact
  def __call__(self, x):
    class Mlp(nn.Module):
      @nn.compact
      def __call__(self, x):
        return DenseGeneral(48, ("embed", "mlp"), name="wi_0")(x)

    class Layers(nn.Module):
      @nn.compact
      def __call__(self, x):
        return Mlp(name="mlp")(x)

    class Decoder(nn.Module):
      @nn.compact
      def __call__(self, x):
        return Layers(name="layers")(x)

    return Decoder(name="decoder")(x)


@pytest.mark.parametrize(
  "mode, forward, backward",
  [
    ("int8", jnp.int8, jnp.int8),
    ("fp8", jnp.float8_e4m3fn, jnp.float8_e4m3fn),
    ("fp8_full", jnp.float8_e4m3fn, jnp.float8_e5m2),
  ],
)
def test_a_projection_is_qwix_own_quantized_dot_general(mode, forward, backward):
  config = make_config(f"quantization={mode}", "use_qwix_quantization=true")
  x = jax.random.normal(jax.random.key(1), (4, 8, 32))
  plain = _Projection()
  params = plain.init(jax.random.key(0), x)
  model = quantized(plain, config)
  kernel = params["params"]["decoder"]["layers"]["mlp"]["wi_0"]["kernel"].value
  qt = qwix_core.DotGeneralQtConfig(
    lhs_qtype=forward, rhs_qtype=forward, dlhs_grad_qtype=backward, drhs_grad_qtype=backward
  )
  reference = lambda x, k: qwix_core.dot_general_qt(x.reshape(32, 32), k, (((1,), (0,)), ((), ())), qt).reshape(
    4, 8, 48
  )
  ours = lambda x, k: model.apply({"params": {"decoder": {"layers": {"mlp": {"wi_0": {"kernel": k}}}}}}, x)
  cotangent = jax.random.normal(jax.random.key(2), (4, 8, 48))
  loss = lambda f: lambda x, k: jnp.sum(f(x, k) * cotangent)
  np.testing.assert_array_equal(ours(x, kernel), reference(x, kernel))
  for got, want in zip(jax.grad(loss(ours), (0, 1))(x, kernel), jax.grad(loss(reference), (0, 1))(x, kernel)):
    np.testing.assert_array_equal(got, want)
  # Quantized for real: the result is not the float32 matmul.
  assert np.abs(np.asarray(ours(x, kernel)) - np.asarray(plain.apply(params, x))).max() > 1e-3


@pytest.mark.parametrize("mode", ["int8", "fp8_full"])
@pytest.mark.parametrize(
  "x_spec, kernel_spec",
  [
    (P(("b", "t")), P()),  # rows over all 8 devices (data, fsdp): each device scales whole rows of its own
    (P("b", None, "t"), P("t", None)),  # rows over 2, the contraction over 4 (tensor): a row's scale spans devices
    (P(None, None, ("b", "t")), P(("b", "t"), None)),
  ],
  ids=["rows8", "rows2_contraction4", "contraction8"],
)
def test_a_sharded_projection_rounds_as_one_device(mode, x_spec, kernel_spec):
  """The same inputs give the same quantized output and gradients in every layout: bit for bit with int8 (its
  products add up exactly, in int32), to float32's last bits with fp8 (whose products XLA:CPU adds in float32, in an
  order that depends on the shard's shape; a value rounded to another fp8 step would move it by an eighth). Without
  Qwix's reciprocal mode (layers/quantization.py) XLA divided by the scale in the sharded programs and multiplied by
  its reciprocal in the one-device one, and with int8 18% of the outputs differed by a rounding step."""
  config = make_config(f"quantization={mode}", "use_qwix_quantization=true")
  x = jax.random.normal(jax.random.key(1), (8, 16, 64))
  plain = _Projection()
  kernel = plain.init(jax.random.key(0), x)["params"]["decoder"]["layers"]["mlp"]["wi_0"]["kernel"].value
  model = quantized(plain, config)
  ours = lambda x, k: model.apply({"params": {"decoder": {"layers": {"mlp": {"wi_0": {"kernel": k}}}}}}, x)
  cotangent = jax.random.normal(jax.random.key(2), (8, 16, 48))

  @jax.jit
  def output_and_gradients(x, k):
    y, vjp = jax.vjp(ours, x, k)
    return (y, *vjp(cotangent))

  one_device = output_and_gradients(x, kernel)
  mesh = jax.make_mesh((2, 4), ("b", "t"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharded = output_and_gradients(
    jax.device_put(x, NamedSharding(mesh, x_spec)), jax.device_put(kernel, NamedSharding(mesh, kernel_spec))
  )
  for name, got, want in zip(("output", "input gradient", "kernel gradient"), sharded, one_device):
    scale = 0 if mode == "int8" else 1e-6 * float(np.abs(want).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=scale, err_msg=name)


def _logits(config, params, ids):
  from MaxLite.models import build

  pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
  return np.asarray(build.model(config).apply({"params": params}, ids, pos, np.ones_like(ids)))


@pytest.mark.slow
def test_only_the_projections_are_quantized():
  """The quantized model's logits differ from the plain model's; making the projections' rule match nothing (a
  path no module has) gives the plain logits back, so nothing outside the projections (attention scores, the
  embedding, the head) is quantized."""
  from MaxLite.layers import quantization
  from MaxLite.models import build

  plain = make_config("model_name=tiny", "max_target_length=32")
  int8 = make_config("model_name=tiny", "max_target_length=32", *INT8)
  params = build.model(plain).init(jax.random.key(0), *(np.ones((2, 32), np.int32),) * 3)["params"]
  ids = np.random.default_rng(0).integers(0, 8192, (2, 32))
  assert np.abs(_logits(int8, params, ids) - _logits(plain, params, ids)).max() > 1e-3
  original = quantization.PROJECTIONS
  quantization.PROJECTIONS = "nothing/matches/this"
  try:
    np.testing.assert_array_equal(_logits(int8, params, ids), _logits(plain, params, ids))
  finally:
    quantization.PROJECTIONS = original


RUN = (
  "model_name=tiny",
  "max_target_length=64",
  "per_device_batch_size=4",
  "steps=30",
  "learning_rate_schedule_steps=30",  # a run stopped at step 15 has the same schedule
  "eval_interval=30",
  "eval_steps=2",
  "enable_tensorboard=false",
  "dataset_type=grain",
)


@pytest.mark.slow
def test_int8_training_follows_full_precision_resumes_exactly_and_its_checkpoint_is_full_precision(tmp_path):
  """30 steps in int8 end within 2% of the unquantized eval loss; an int8 run resumed from step 15 gives the
  uninterrupted run's losses bit for bit; the checkpoint resumes without quantization and exports to transformers,
  whose logits are MaxLite's unquantized logits of those weights."""
  rows = {}
  for name, extra in (("plain", ()), ("int8", (*INT8, "checkpoint_period=15"))):
    config = make_config(*RUN, f"base_output_directory={tmp_path}", f"run_name={name}", *extra, num_devices=1)
    rows[name] = train(config, first_devices(1))
  evals = {k: [r["eval_loss"] for r in v if "eval_loss" in r][-1] for k, v in rows.items()}
  losses = {k: [r["loss"] for r in v if "loss" in r] for k, v in rows.items()}
  print(f"eval loss after 30 steps: plain {evals['plain']:.4f}, int8 {evals['int8']:.4f}")
  assert losses["int8"][-1] < losses["int8"][0] - 1.0  # it learns
  assert losses["int8"] != losses["plain"]  # and is quantized
  assert abs(evals["int8"] - evals["plain"]) / evals["plain"] < 0.02
  # Killed after step 30, before its save, in effect: resumed from step 15, steps 16-30 run again bit for bit.
  again = make_config(*RUN, f"base_output_directory={tmp_path}", "run_name=int8", *INT8, "checkpoint_period=15")
  assert [r["loss"] for r in rerun_from_the_checkpoint_before_the_last(again) if "loss" in r] == losses["int8"][15:]
  # The QT checkpoint is full precision: a run without quantization resumes it...
  resumed = make_config(
    *RUN, f"base_output_directory={tmp_path}", "run_name=int8", "steps=32", "enable_checkpointing=true", num_devices=1
  )
  more = train(resumed, first_devices(1))
  assert [r["step"] for r in more if "loss" in r] == [31, 32]
  # ...and transformers reads it as MaxLite's unquantized model.
  pytest.importorskip("transformers")
  from support.hf import export_gives_maxlite_logits

  export_gives_maxlite_logits(str(tmp_path / "int8" / "checkpoints" / "30"), str(tmp_path / "hf"))


@pytest.mark.parametrize(
  "overrides, fragment",
  [
    (
      ("quantization=int4", "use_qwix_quantization=true"),
      "quantization='int4' is not one of: '', 'int8', 'fp8', 'fp8_full' (Qwix's quantized training; int4 and MaxText's "
      "other modes are not supported)",
    ),
    (("quantization=int8",), "quantization=int8 needs use_qwix_quantization=true"),
    (
      (*INT8, "bwd_quantization_calibration_method=percentile"),
      "bwd_quantization_calibration_method='percentile' is not a Qwix calibration method",
    ),
  ],
)
def test_bad_quantization_settings_are_one_line(overrides, fragment):
  with pytest.raises(ConfigError, match=re.escape(fragment)) as caught:
    make_config(*overrides)
  assert "\n" not in str(caught.value)


def test_the_compile_report_counts_the_dots_that_run_in_int8():
  """dot_operand_types reads the compiled program: an int8 matmul is s8 x s8, a float one f32 x f32."""
  from MaxLite.aot.compile_step import dot_operand_types

  dot = lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
  both = jax.jit(lambda a, b, c, d: (dot(a, b), c @ d))
  int8, f32 = jnp.ones((4, 8), jnp.int8), jnp.ones((8, 8), jnp.float32)
  counts = dot_operand_types(both.lower(int8, int8.T, f32, f32).compile().as_text())
  assert counts == {("s8", "s8"): 1, ("f32", "f32"): 1}


def test_the_planner_costs_int8_dots_at_the_chips_int8_rate():
  """An int8 dot of a compiled program is read as such and costed at the chip's int8 peak (v5p: twice bf16); a chip
  without fp8 costs fp8 at the bf16 rate and is named at start."""
  from MaxLite.layers.quantization import native_path_note
  from MaxLite.parallel.topologies import CHIPS
  from MaxLite.planning.hlo_costs import device_ops
  from MaxLite.planning.perf_model import matmul_seconds

  dot = lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
  text = jax.jit(dot).lower(jnp.ones((64, 128), jnp.int8), jnp.ones((128, 32), jnp.int8)).compile().as_text()
  (op,) = [o for o in device_ops(text, ("data",), (1,)) if o.flops]
  assert op.flops == 2 * 64 * 128 * 32 and op.typed_flops == {"s8": op.flops}
  float_op = dataclasses.replace(op, typed_flops={})
  v5p = CHIPS["v5p"]
  assert matmul_seconds(float_op, v5p) == pytest.approx(2 * matmul_seconds(op, v5p))
  fp8_op = dataclasses.replace(op, typed_flops={"f8e4m3fn": op.flops})
  assert matmul_seconds(fp8_op, v5p) == pytest.approx(matmul_seconds(float_op, v5p))
  assert "no native fp8" in native_path_note("fp8", "v5p", v5p.peak_int8_tops, v5p.peak_fp8_tflops)
  assert native_path_note("int8", "v5p", v5p.peak_int8_tops, v5p.peak_fp8_tflops) is None


@pytest.mark.slow
@pytest.mark.skipif(topologies.find_libtpu(REPO) is None, reason="libtpu not installed (bash setup.sh)")
def test_plan_searches_quantization_as_a_dimension(tmp_path):
  """plan_quantizations=['', int8] ranks the same layout in bf16 and int8 side by side; compiled for TPU chips in
  plan.py's worker processes (libtpu loaded there, as on a user's laptop)."""
  import subprocess
  import sys

  args = ["model_name=tiny", "compile_topology=v5e-8", "max_target_length=64", "ici_fsdp_parallelism=8"]
  args += ["ici_tensor_parallelism=1", "ici_data_parallelism=1", "ici_sequence_parallelism=1"]
  args += ["ici_pipeline_parallelism=1", "ici_expert_parallelism=1", "remat_policy=full", "per_device_batch_size=1"]
  args += ["attention=dot_product", "plan_quantizations=['',int8]", "plan_workers=1", f"plan_cache_dir={tmp_path}"]
  args += [f"--plan_output={tmp_path / 'best.yml'}"]
  env = {**__import__("os").environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(
    [sys.executable, "MaxLite/plan.py", "configs/base.yml", *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [line for line in out.stdout.splitlines() if "fsdp8 | full | dot_product | b1" in line]
  assert sum("| int8" in r for r in rows) == 1 and sum("| int8" not in r for r in rows) >= 1, out.stdout


def _int8_matmuls(config) -> int:
  """How many matmuls of the model's forward pass take int8 operands (each traced layer counted once)."""
  import jax.extend as jex

  from MaxLite.models import build

  ids = np.ones((2, 32), np.int32)
  params = jax.eval_shape(lambda: build.model(config).init(jax.random.key(0), ids, ids, ids))["params"]
  traced = jax.make_jaxpr(lambda p: build.model(config).apply({"params": p}, ids, ids, ids))(params)

  def eqns(jaxpr):
    for eqn in jaxpr.eqns:
      yield eqn
      for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else [value]:
          if isinstance(sub, jex.core.ClosedJaxpr):
            yield from eqns(sub.jaxpr)
          elif isinstance(sub, jex.core.Jaxpr):
            yield from eqns(sub)

  dots = [e for e in eqns(traced.jaxpr) if e.primitive.name == "dot_general"]
  return sum(all(v.aval.dtype == jnp.int8 for v in e.invars[:2]) for e in dots)


# Each family's projections, as its layer defines them (one traced layer per scanned stack):
# Llama-shaped and Gemma 3: q, k, v, out, gate, up, down. DeepSeek (a dense stack, then a MoE one): MLA's wq_a, wq_b,
# wkv_a, wkv_b, out, then the MLP's or the shared experts' gate, up, down. Mixtral-shaped and GPT-OSS: q, k, v, out
# (their routed experts and router stay in the compute dtype, as the module docstring says).
PROJECTIONS_PER_FAMILY = [
  ("tiny", (), 7),
  ("tiny", ("scan_layers=false",), 7 * 2),
  ("tiny-gemma3", (), 7),
  ("tiny-deepseek", (), 2 * (5 + 3)),
  ("tiny-deepseek", ("scan_layers=false",), 4 * (5 + 3)),
  ("tiny-moe", (), 4),
  ("tiny-gpt-oss", (), 4),
]


@pytest.mark.slow
@pytest.mark.parametrize("model, options, projections", PROJECTIONS_PER_FAMILY)
def test_every_projection_of_every_family_is_quantized(model, options, projections):
  assert _int8_matmuls(make_config(f"model_name={model}", "max_target_length=32", *options, *INT8)) == projections
  assert _int8_matmuls(make_config(f"model_name={model}", "max_target_length=32", *options)) == 0


def test_gpus_are_known_by_device_kind_with_their_fp8_and_int8_rates():
  """An H100 or H200 has fp8 and int8 tensor cores: quantization=fp8 there is no emulation (the warning said so on
  every GPU before); an A100 has int8 but no fp8. The chip's bf16 peak is what MFU is measured against."""
  from MaxLite.layers.quantization import native_path_note

  h100 = topologies.accelerator_chip("gpu", "NVIDIA H100 80GB HBM3", {})
  h200 = topologies.accelerator_chip("cuda", "NVIDIA H200", {})
  pcie = topologies.gpu_chip("NVIDIA H100 PCIe")
  a100 = topologies.gpu_chip("NVIDIA A100-SXM4-80GB")
  assert (h100.family, h200.family, pcie.family, a100.family) == ("H100", "H200", "H100 PCIe", "A100")
  assert h100.peak_bf16_tflops == h200.peak_bf16_tflops == 989.4 and h200.hbm_bytes > h100.hbm_bytes
  for chip in (h100, h200):
    assert native_path_note("fp8", chip.family, chip.peak_int8_tops, chip.peak_fp8_tflops) is None
    assert native_path_note("int8", chip.family, chip.peak_int8_tops, chip.peak_fp8_tflops) is None
  assert "no native fp8" in native_path_note("fp8", "A100", a100.peak_int8_tops, a100.peak_fp8_tflops)
  assert topologies.gpu_chip("NVIDIA GeForce RTX 4090") is None
  assert topologies.accelerator_chip("tpu", "TPU v5p", {"TPU_ACCELERATOR_TYPE": "v5p-8"}).family == "v5p"
  assert topologies.accelerator_chip("cpu", "cpu", {}) is None
  # a jax device reads the same: by its platform and device_kind (this process's CPU device has no chip figures)
  import jax

  assert topologies.device_chip(jax.devices()[0]) is None
  gpu = type("CudaDevice", (), {"platform": "gpu", "device_kind": "NVIDIA H200"})()
  assert topologies.device_chip(gpu, {}).family == "H200"
