"""GPT-OSS (decoder_block=gpt_oss), what only it does: packed rows give each document transformers' logits and greedy
tokens in shapes the family table does not have; the clamp decides the experts' output; MXFP4 experts dequantize as
transformers does and a checkpoint of them imports with its logits; the published configs' values and parameter counts;
sinks choose a kernel that computes them (splash does, interpreted here; cuDNN does not); LoRA on it exports to peft
with MaxLite's logits; eight devices train like one. Its conversion from transformers (logits on both MoE paths, greedy
tokens, the exact export), scanned and unscanned, is tests/checkpoint/test_hf_models.py's table, rows gpt_oss*."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.config import first_devices, make_config
from support.hf import (
  SEQ,
  TINY_GPT_OSS,
  maxlite_config,
  maxlite_logits,
  maxlite_params,
  tiny_hf_model,
  token_ids,
  transformers_logits,
)
from support.layouts import cached_rows, loss_curves, train_layout
from support.lora import ATTENTION_ONLY, LORA, lora_logits

from MaxLite.checkpoint import hf as convert_hf
from MaxLite.checkpoint.safetensors_io import read_file, write_file
from MaxLite.cli.errors import ConfigError, InputError
from MaxLite.decode import generate
from MaxLite.models import gpt_oss_hf, mxfp4
from MaxLite.models.transformer import Transformer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def hf_gpt_oss(tmp_path, name="gpt_oss", **overrides):
  """tests/checkpoint/test_hf_models.py's tiny GptOssForCausalLM (eager attention; norms, biases and sinks off their
  init)."""
  settings = {**TINY_GPT_OSS, **overrides}
  return tiny_hf_model(str(tmp_path / name), "GptOssForCausalLM", "GptOssConfig", settings, eager=True)


def _theirs(model, ids):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(ids)[None])).logits.numpy()[0]


# MQA, no window (every layer full), no attention biases, tied embeddings, default RoPE, a wider clamp, unscanned:
# unlike the table's rows.
OTHER_SHAPE = dict(
  num_key_value_heads=1,
  layer_types=["full_attention"] * 3,  # the table's sliding_window of 5 then applies to no layer
  attention_bias=False,
  tie_word_embeddings=True,
  swiglu_limit=0.5,
  rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)


@pytest.mark.slow
@pytest.mark.parametrize("shape, scan_layers", [("table", "true"), ("other", "false")])
def test_packed_rows_give_each_document_its_own_logits_and_greedy_tokens(tmp_path, shape, scan_layers):
  model, path = hf_gpt_oss(tmp_path, **(OTHER_SHAPE if shape == "other" else {}))
  step = convert_hf.to_maxlite(path, str(tmp_path / "ml"), [f"scan_layers={scan_layers}"])
  config = maxlite_config(step)
  params = maxlite_params(config, step)
  docs = [token_ids(384, 1)[0, :9], token_ids(384, 1)[0, 9:]]  # 9 + 15 tokens: longer than the window of 5
  row = np.concatenate(docs)[None]
  positions = np.concatenate([np.arange(len(d)) for d in docs])[None]
  segments = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)])[None]
  ours = np.asarray(jax.jit(Transformer(config).apply)({"params": params}, row, positions, segments))[0]
  theirs = np.concatenate([_theirs(model, d) for d in docs])
  print(f"{shape}: max abs logit difference {np.abs(ours - theirs).max():.2e}, logits up to {np.abs(theirs).max():.2f}")
  np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=0)
  if shape == "table":  # the clamp is what the experts' output is made of: without it the logits move
    unclamped = maxlite_config(step, "mlp_activations_limit=-1")
    assert np.abs(maxlite_logits(unclamped, params, row) - maxlite_logits(config, params, row)).max() > 1e-3
  else:
    prompt = [3, 200, 17, 91, 5]
    decoding = maxlite_config(step, "max_prefill_predict_length=8", "max_decode_steps=12")
    greedy, _ = generate(decoding, params, [prompt], eos_id=None)
    with torch.no_grad():
      expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert greedy[0] == expected[0, len(prompt) :].tolist()
    convert_hf.to_hf(step, str(tmp_path / "back"), [])  # unscanned, tied, without biases or window: back exactly
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), attn_implementation="eager")
    assert reloaded.config.layer_types == OTHER_SHAPE["layer_types"]
    for name, tensor in reloaded.state_dict().items():
      assert torch.equal(tensor, model.state_dict()[name]), name


def test_mxfp4_dequantizes_as_transformers_does():
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors

  rng = np.random.default_rng(0)
  blocks = rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8)  # 3 experts, 10 output rows, 4 groups of 32 inputs
  scales = rng.integers(0, 253, (3, 10, 4), dtype=np.uint8)  # exponents from 2^-127 to 2^125 (6 x 2^126 is inf)
  theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
  ours = mxfp4.dequantize(blocks, scales)
  assert ours.shape == (3, 128, 10) and ours.dtype == np.float32
  np.testing.assert_array_equal(ours, theirs.numpy())
  with pytest.raises(ValueError, match="do not fit together"):
    mxfp4.dequantize(blocks, scales[..., :3])


@pytest.mark.slow
def test_an_mxfp4_checkpoint_imports_with_the_dequantized_model_s_logits_and_exports_unquantized(tmp_path):
  """OpenAI's layout: gate_up_proj / down_proj as _blocks and _scales, quantization_config mxfp4. transformers' model
  given its own dequantization of them is the reference; the export writes them unquantized."""
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors

  model, path = hf_gpt_oss(tmp_path, intermediate_size=64)  # MXFP4 groups 32 inputs: both widths divide
  tensors = read_file(os.path.join(path, "model.safetensors"))
  rng = np.random.default_rng(0)
  for layer, block in enumerate(model.model.layers):
    for proj, (rows, inputs) in (("gate_up_proj", (128, 64)), ("down_proj", (64, 64))):
      name = f"model.layers.{layer}.mlp.experts.{proj}"
      blocks = rng.integers(0, 256, (4, rows, inputs // 32, 16), dtype=np.uint8)
      scales = rng.integers(119, 124, (4, rows, inputs // 32), dtype=np.uint8)  # values up to 6 * 2^-4
      del tensors[name]
      tensors.update({name + "_blocks": blocks, name + "_scales": scales})
      weight = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
      getattr(block.mlp.experts, proj).data.copy_(weight)
  write_file(os.path.join(path, "model.safetensors"), tensors)
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({**hf, "quantization_config": {"quant_method": "mxfp4"}}, f)
  step = convert_hf.to_maxlite(path, str(tmp_path / "ml"), [])
  config = maxlite_config(step)
  ids = token_ids(384)
  with torch.no_grad():
    expected = model(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(maxlite_logits(config, maxlite_params(config, step), ids), expected, atol=2e-5, rtol=0)
  convert_hf.to_hf(step, str(tmp_path / "back"), [])
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), attn_implementation="eager")
  for name, tensor in reloaded.state_dict().items():
    assert torch.equal(tensor, model.state_dict()[name]), name


# The fields of openai/gpt-oss-20b's and -120b's config.json (Hugging Face Hub) that decide the model.
_PUBLISHED = dict(
  architectures=["GptOssForCausalLM"],
  attention_bias=True,
  head_dim=64,
  hidden_act="silu",
  hidden_size=2880,
  intermediate_size=2880,
  max_position_embeddings=131072,
  num_attention_heads=64,
  num_experts_per_tok=4,
  num_key_value_heads=8,
  rms_norm_eps=1e-05,
  rope_scaling={
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "rope_type": "yarn",
    "truncate": False,
  },
  rope_theta=150000,
  sliding_window=128,
  swiglu_limit=7.0,
  tie_word_embeddings=False,
  vocab_size=201088,
  quantization_config={"quant_method": "mxfp4"},
)
PUBLISHED = {
  "gpt-oss-20b": (dict(_PUBLISHED, num_hidden_layers=24, num_local_experts=32), 20_914_757_184),
  "gpt-oss-120b": (dict(_PUBLISHED, num_hidden_layers=36, num_local_experts=128), 116_829_156_672),
}


@pytest.mark.parametrize("model_name", list(PUBLISHED))
def test_shipped_configs_hold_the_published_values_and_transformers_parameter_count(model_name):
  from MaxLite import models

  published, parameters = PUBLISHED[model_name]
  settings = gpt_oss_hf.settings_from_hf(published, "config.json")
  config = make_config(f"model_name={model_name}")
  as_read = {key: tuple(v) if isinstance(v, list) else v for key, v in settings.items()}  # a config's lists: tuples
  assert {key: getattr(config, key) for key in settings} == as_read
  hf = models.family("gpt_oss").hf.config(config)
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf))
  assert config.num_params == sum(p.numel() for p in model.parameters()) == parameters  # 20.91B, 116.83B


def test_sinks_choose_a_kernel_that_computes_them():
  """cuDNN computes no sinks: autoselected on a GPU falls back to dot_product and says why, an explicit cudnn is
  one line; splash computes them, so a TPU keeps it."""
  from support.config import derived_keys

  gpu = derived_keys("model_name=tiny-gpt-oss", "dtype=bfloat16", platform="gpu")
  assert gpu["attention_kernel"] == "dot_product"
  assert gpu["attention_choice"] == (
    "autoselected: dot_product, not cudnn, because it does not compute attention sinks (a learned logit per head in "
    "the softmax), which attention_sink=true asks for"
  )
  assert derived_keys("model_name=tiny-gpt-oss", "dtype=bfloat16", "attention_sink=false", platform="gpu")[
    "attention_kernel"
  ] == ("cudnn")
  assert (
    derived_keys("model_name=tiny-gpt-oss", "max_target_length=256", platform="tpu")["attention_kernel"] == "splash"
  )
  with pytest.raises(ConfigError, match=r"^attention=cudnn does not compute attention sinks .* attention_sink=true"):
    derived_keys("model_name=tiny-gpt-oss", "dtype=bfloat16", "attention=cudnn", platform="gpu")


@pytest.mark.parametrize(
  "mesh", [(), ("ici_fsdp_parallelism=2", "ici_sequence_parallelism=2", "ici_tensor_parallelism=2")]
)
def test_splash_computes_the_sinks_and_their_gradient_as_dot_product(mesh):
  """Alone and under shard_map on 8 devices (each head shard its heads' sinks; their gradient summed over the batch
  and sequence shards), with a window."""
  from flax.linen import partitioning as nn_partitioning

  from MaxLite.layers.attention import attention_mask, dot_product_attention
  from MaxLite.layers.splash import splash_attention
  from MaxLite.parallel import sharding
  from MaxLite.parallel.mesh import create_mesh

  seq, devices = 256, 8 if mesh else 1
  heads = ("base_num_query_heads=4", "base_num_kv_heads=2", *(("per_device_batch_size=0.25",) if mesh else ()))
  config = make_config(
    "model_name=tiny", f"max_target_length={seq}", "attention=splash", *heads, *mesh, num_devices=devices
  )
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (2, seq, 4, 16)) * 0.25
  k, v = jax.random.normal(keys[1], (2, seq, 2, 16)), jax.random.normal(keys[2], (2, seq, 2, 16))
  sinks = jax.random.normal(keys[3], (4,))
  segments = jnp.asarray([[1] * 70 + [2] * 160 + [0] * 26, [1] * 200 + [2] * 56], jnp.int32)
  real = (segments != 0)[:, :, None, None]

  def loss_and_grads(attend):
    loss = lambda q, k, v, s: jnp.sum(jnp.where(real, jnp.sin(attend(q, k, v, s)), 0.0))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)

  window = 40
  with (
    jax.set_mesh(create_mesh(config, first_devices(devices))),
    nn_partitioning.axis_rules(sharding.axis_rules(config)),
  ):
    ours = loss_and_grads(lambda q, k, v, s: splash_attention(q, k, v, segments, config, True, window, sinks=s))
  theirs = loss_and_grads(lambda q, k, v, s: dot_product_attention(q, k, v, attention_mask(segments, window), sinks=s))
  np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5)
  for got, want in zip(ours[1], theirs[1]):
    np.testing.assert_allclose(got, want, atol=1e-4)
  assert np.abs(theirs[1][3]).min() > 0  # every sink has a gradient


@pytest.mark.parametrize(
  "overrides, fragment",
  [
    (("num_experts=1",), "decoder_block=gpt_oss is a mixture of experts"),
    (("routed_score_func=sigmoid",), "routes by a softmax over each token's top-k logits"),
    (("routed_bias_update_rate=0.01",), "router bias (routed_bias) is learned by its gradient"),
    (("mlp_activations=[silu,linear]",), "is not supported by decoder_block=gpt_oss; use ['sigmoid', 'linear']"),
    (("mlp_activations_limit=0",), "mlp_activations_limit=0.0 must be > 0 or -1"),
  ],
)
def test_bad_gpt_oss_settings_fail_with_one_line(overrides, fragment):
  with pytest.raises(ConfigError, match=re.escape(fragment)) as caught:
    make_config("model_name=tiny-gpt-oss", *overrides)
  assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
  "change, fragment",
  [
    ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5 is not supported"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 12}, "layer_types must alternate"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1, "high_freq_factor": 4}}, "llama3.1"),
  ],
)
def test_unsupported_config_json_is_one_line_naming_the_field(change, fragment):
  with pytest.raises(InputError, match=re.escape(fragment)) as caught:
    gpt_oss_hf.settings_from_hf({**PUBLISHED["gpt-oss-20b"][0], **change}, "config.json")
  assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_lora_on_gpt_oss_exports_a_peft_adapter_with_maxlite_logits(tmp_path):
  """Adapters on the attention projections (whose o_proj has a bias and whose softmax has sinks), trained 2 steps:
  transformers with peft's adapter gives the LoRA model's logits."""
  from MaxLite.training.trainer import train

  base_model, hf_path = hf_gpt_oss(tmp_path)
  base_step = convert_hf.to_maxlite(hf_path, str(tmp_path / "base"), [])
  run = (*LORA, ATTENTION_ONLY, f"load_parameters_path={base_step}", f"max_target_length={SEQ}", "learning_rate=1e-2")
  run += ("dataset_type=synthetic", "per_device_batch_size=2", "enable_tensorboard=false")
  train(make_config(*run, "steps=2", f"base_output_directory={tmp_path}", "run_name=lora"), first_devices(1))
  step = str(tmp_path / "lora" / "checkpoints" / "2")
  convert_hf.to_hf(step, str(tmp_path / "export"), [])
  ids = token_ids(384)
  ours, _ = lora_logits(make_config(*run, f"lora_restore_path={step}"), ids)
  base_logits = transformers_logits(base_model, ids)
  with_adapter = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "export" / "adapter")).eval()
  assert np.abs(transformers_logits(with_adapter, ids) - ours).max() <= 1e-4
  assert np.abs(ours - base_logits).max() > 1e-4  # the adapters did train


TINY = ("model_name=tiny-gpt-oss", "megablox=false")  # ragged_dot: the grouped matmuls, not interpreted


@pytest.mark.slow
def test_eight_devices_train_like_one(tmp_path):
  """fsdp x tensor x expert: sinks and expert biases split by heads and experts, the experts' rows sent to their
  shard; the same losses and gradient norms as one device."""
  reference = loss_curves(cached_rows(1, *TINY, "per_device_batch_size=8"))
  mesh = ("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "ici_expert_parallelism=2")
  rows = train_layout(tmp_path, 8, *TINY, "per_device_batch_size=1", *mesh)
  losses, grad_norms = loss_curves(rows)
  np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
  np.testing.assert_allclose(grad_norms, reference[1], rtol=1e-5)
