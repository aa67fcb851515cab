"""Every family from transformers, one table row each (Llama 3.1/3.2 with RoPE scaling and YaRN, Qwen2.5 with q/k/v
biases, Qwen3 with q/k norm, Qwen3-MoE, Mixtral, Gemma 3, DeepSeek-V3, GPT-OSS): converted weights give transformers'
logits and greedy tokens, and export back bit for bit. A new family is a new row; what only one family does stays in its
own file (tests/models/test_gemma3.py, tests/models/test_deepseek.py, tests/models/test_gpt_oss.py). Also: the shipped
configs hold the published config.json values and parameter counts, and unsupported checkpoints are refused in one
line."""

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from support.hf import (
  DEEPSEEK_YARN,
  SMALL,
  TINY_DEEPSEEK,
  TINY_GEMMA3,
  TINY_GPT_OSS,
  maxlite_config,
  maxlite_logits,
  maxlite_params,
  tiny_hf_model,
  token_ids,
)

from MaxLite.checkpoint import hf as convert_hf
from MaxLite.cli.errors import InputError
from MaxLite.decode import generate
from MaxLite.models.hf_layout import model_settings_from_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)


@dataclasses.dataclass(frozen=True)
class Family:
  """One row of the family table: a tiny transformers model, and what its conversion to MaxLite must give."""

  architecture: str  # transformers' model class
  config_class: str  # transformers' config class
  settings: dict  # its arguments
  convert: tuple[str, ...] = ()  # to_maxlite's key=value overrides
  expect: dict = dataclasses.field(default_factory=dict)  # keys the converted config must hold
  # MaxLite's paths that must each give transformers' logits (both MoE dispatches for DeepSeek)
  dispatches: tuple[tuple[str, ...], ...] = ((),)
  prompt: tuple[int, ...] = (3, 200, 17, 91, 5)
  eager: bool = False  # transformers' eager attention, for its sliding window (Gemma 3) and MLA (DeepSeek)
  tolerance: float = 2e-5  # float32 logits' max abs difference from transformers'


def _small(architecture: str, rope: dict, **overrides) -> Family:
  """A Llama-shaped family (Llama, Qwen2/3, Qwen3-MoE, Mixtral) at SMALL's size with its RoPE."""
  rope_parameters = {"rope_theta": 10000.0, **rope}
  return Family(
    f"{architecture}ForCausalLM",
    f"{architecture}Config",
    {**SMALL, "rms_norm_eps": 1e-6, **overrides, "rope_parameters": rope_parameters},
  )


def _gemma3(scan_layers: str, **overrides) -> Family:
  return Family(
    "Gemma3ForCausalLM",
    "Gemma3TextConfig",
    {**TINY_GEMMA3, **overrides},
    convert=(f"scan_layers={scan_layers}",),
    expect=dict(decoder_block="gemma3", sliding_window_size=5),
    prompt=(3, 200, 17, 91, 5, 8, 40),
    eager=True,
  )


def _gpt_oss(scan_layers: str, **overrides) -> Family:
  return Family(
    "GptOssForCausalLM",
    "GptOssConfig",
    {**TINY_GPT_OSS, **overrides},
    convert=(f"scan_layers={scan_layers}",),
    expect=dict(decoder_block="gpt_oss", attention_sink=True, sliding_window_size=5, mlp_activations_limit=0.2),
    dispatches=(("sparse_matmul=true",), ("sparse_matmul=false",)),
    prompt=(3, 200, 17, 91, 5, 8, 40),
    eager=True,
  )


def _deepseek(scan_layers: str, **overrides) -> Family:
  return Family(
    "DeepseekV3ForCausalLM",
    "DeepseekV3Config",
    {**TINY_DEEPSEEK, **overrides},
    convert=(f"scan_layers={scan_layers}",),
    expect=dict(decoder_block="deepseek", attention_type="mla"),
    dispatches=(("sparse_matmul=false",), ("sparse_matmul=true",)),
    eager=True,
  )


GEMMA3_4B_LIKE = dict(rope_scaling={"rope_type": "linear", "factor": 8.0})  # 4b/12b: query_pre_attn_scalar = head_dim
GEMMA3_27B_LIKE = dict(query_pre_attn_scalar=20, rope_local_base_freq=500.0, rope_theta=12345.0)
FAMILIES = {
  # original context 16 < SEQ, so the scaled frequencies matter within the test's sequences
  "llama3.2_tied": _small("Llama", dict(LLAMA3_ROPE, original_max_position_embeddings=16), tie_word_embeddings=True),
  # cos/sin by the mscale / mscale_all_dim ratio (transformers' rule for any YaRN model), the softmax untouched
  "llama_yarn_mscales": _small(
    "Llama", dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.4)
  ),
  "qwen2.5": _small("Qwen2", dict(rope_type="default"), num_key_value_heads=1),
  "qwen3_tied": _small("Qwen3", dict(rope_type="default"), head_dim=24, tie_word_embeddings=True),
  "qwen3_yarn": _small("Qwen3", dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=12), head_dim=32),
  "qwen3_moe": _small(
    "Qwen3Moe",
    dict(rope_type="default"),
    head_dim=16,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    norm_topk_prob=True,
  ),
  "qwen3_moe_unnormalised": _small(
    "Qwen3Moe",
    dict(rope_type="default"),
    num_experts=4,
    num_experts_per_tok=3,
    moe_intermediate_size=32,
    norm_topk_prob=False,
  ),
  # no q/k norm: exports as Mixtral; its router (mlp.gate.weight in transformers' modules) is perturbed too
  "mixtral": _small("Mixtral", dict(rope_type="default"), num_local_experts=4, num_experts_per_tok=2),
  "gemma3_4b_like": _gemma3("true", **GEMMA3_4B_LIKE),
  "gemma3_4b_like_unscanned": _gemma3("false", **GEMMA3_4B_LIKE),
  "gemma3_27b_like": _gemma3("true", **GEMMA3_27B_LIKE),
  # grouped routing with a random routing bias
  "deepseek_v3": _deepseek("true"),
  "deepseek_v3_unscanned": _deepseek("false"),
  "deepseek_no_q_lora_yarn": _deepseek(
    "true", q_lora_rank=None, rope_parameters=DEEPSEEK_YARN, max_position_embeddings=1024
  ),
  "deepseek_no_groups": _deepseek("true", n_group=1, topk_group=1, first_k_dense_replace=0, n_shared_experts=2),
  # sinks, alternating window and full layers, YaRN, biased router and experts, the clamped unit (unscanned and
  # another shape: tests/models/test_gpt_oss.py)
  "gpt_oss": _gpt_oss("true"),
}


@dataclasses.dataclass
class Converted:
  """A row's transformers model, its folder, the MaxLite step converted from it and that step exported back."""

  family: Family
  model: Any
  hf_path: str
  step_dir: str
  export_path: str


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Callable[[str], Converted]:
  """Gives a row by name, converted and exported once for every test of the module that uses it (whatever order
  they run in: a module-scoped fixture parametrized by row would be rebuilt each time the row changes)."""
  done = {}

  def row(name: str) -> Converted:
    if name not in done:
      family, tmp_path = FAMILIES[name], tmp_path_factory.mktemp(name)
      settings = (family.architecture, family.config_class, family.settings, family.eager)
      model, path = tiny_hf_model(str(tmp_path / "hf"), *settings)
      step_dir = convert_hf.to_maxlite(path, str(tmp_path / "ml"), list(family.convert))
      convert_hf.to_hf(step_dir, str(tmp_path / "back"), [])
      done[name] = Converted(family, model, path, step_dir, str(tmp_path / "back"))
    return done[name]

  return row


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_converted_model_matches_transformers_and_exports_back_exactly(converted, name):
  converted = converted(name)
  row, model, step_dir = converted.family, converted.model, converted.step_dir
  config = maxlite_config(step_dir, *row.dispatches[0])
  assert {key: getattr(config, key) for key in row.expect} == row.expect
  params = maxlite_params(config, step_dir)
  ids = token_ids(model.config.vocab_size)
  with torch.no_grad():
    expected = model(torch.tensor(ids)).logits.numpy()
  for dispatch in row.dispatches:
    diff = np.abs(maxlite_logits(maxlite_config(step_dir, *dispatch), params, ids) - expected).max()
    print(f"{row.architecture} {dispatch}: max abs logit difference {diff:.2e}")
    assert diff <= row.tolerance

  prompt = list(row.prompt)
  decoding = maxlite_config(step_dir, "max_prefill_predict_length=8", "max_decode_steps=14")
  ours, _ = generate(decoding, params, [prompt], eos_id=None)
  with torch.no_grad():
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False, eos_token_id=None)
  assert ours[0] == theirs[0, len(prompt) :].tolist()

  eager = {"attn_implementation": "eager"} if row.eager else {}
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(converted.export_path, **eager)
  assert type(reloaded) is type(model)
  original = model.state_dict()
  assert set(reloaded.state_dict()) == set(original)
  for name, tensor in reloaded.state_dict().items():
    assert torch.equal(tensor, original[name]), name
  with torch.no_grad():
    np.testing.assert_array_equal(reloaded(torch.tensor(ids)).logits.numpy(), expected)


# The fields of each model's published config.json (Hugging Face Hub) that decide the model.
_LLAMA3_SCALING = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "rms_norm_eps": 1e-05, "rope_theta": 500000.0}
_LLAMA3.update(num_key_value_heads=8, max_position_embeddings=131072, hidden_act="silu")
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0}
_QWEN3.update(head_dim=128, max_position_embeddings=40960, hidden_act="silu", use_sliding_window=False)
PUBLISHED_CONFIGS = {
  "llama3.1-8b": dict(
    _LLAMA3,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_hidden_layers=32,
    tie_word_embeddings=False,
    rope_scaling=dict(_LLAMA3_SCALING, factor=8.0, original_max_position_embeddings=8192),
  ),
  "llama3.1-70b": dict(
    _LLAMA3,
    hidden_size=8192,
    intermediate_size=28672,
    num_attention_heads=64,
    num_hidden_layers=80,
    tie_word_embeddings=False,
    rope_scaling=dict(_LLAMA3_SCALING, factor=8.0, original_max_position_embeddings=8192),
  ),
  "llama3.2-1b": dict(
    _LLAMA3,
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_hidden_layers=16,
    head_dim=64,
    tie_word_embeddings=True,
    rope_scaling=dict(_LLAMA3_SCALING, factor=32.0, original_max_position_embeddings=8192),
  ),
  "llama3.2-3b": dict(
    _LLAMA3,
    hidden_size=3072,
    intermediate_size=8192,
    num_attention_heads=24,
    num_hidden_layers=28,
    head_dim=128,
    tie_word_embeddings=True,
    rope_scaling=dict(_LLAMA3_SCALING, factor=32.0, original_max_position_embeddings=8192),
  ),
  "qwen2.5-7b": dict(
    architectures=["Qwen2ForCausalLM"],
    hidden_size=3584,
    intermediate_size=18944,
    num_attention_heads=28,
    num_key_value_heads=4,
    num_hidden_layers=28,
    vocab_size=152064,
    rms_norm_eps=1e-06,
    rope_theta=1000000.0,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    use_sliding_window=False,
    hidden_act="silu",
  ),
  "qwen3-0.6b": dict(
    _QWEN3,
    hidden_size=1024,
    intermediate_size=3072,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_hidden_layers=28,
    tie_word_embeddings=True,
  ),
  "qwen3-8b": dict(
    _QWEN3,
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=36,
    tie_word_embeddings=False,
  ),
  "qwen3-30b-a3b": dict(
    _QWEN3,
    architectures=["Qwen3MoeForCausalLM"],
    hidden_size=2048,
    intermediate_size=6144,
    num_attention_heads=32,
    num_key_value_heads=4,
    num_hidden_layers=48,
    tie_word_embeddings=False,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
  ),
  "mixtral-8x7b": dict(
    architectures=["MixtralForCausalLM"],
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=32,
    rms_norm_eps=1e-05,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    hidden_act="silu",
    sliding_window=None,
    tie_word_embeddings=False,
    num_local_experts=8,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.02,
  ),
}
LLAMA_3_2_1B = PUBLISHED_CONFIGS["llama3.2-1b"]


@pytest.mark.parametrize("model_name", list(PUBLISHED_CONFIGS))
def test_shipped_model_configs_hold_the_published_config_json_values(model_name):
  from support.config import make_config

  settings = model_settings_from_hf(PUBLISHED_CONFIGS[model_name], "config.json")
  shipped = make_config(f"model_name={model_name}")
  assert {key: getattr(shipped, key) for key in settings} == settings


@pytest.mark.parametrize(
  "change, fragment",
  [
    ({"architectures": ["Gemma2ForCausalLM"]}, "architecture 'Gemma2ForCausalLM' is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type='longrope' is not supported"),
    ({"attention_bias": True}, "attention_bias=true is not supported for LlamaForCausalLM"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor is not supported"),
    (
      {"architectures": ["MistralForCausalLM"]},
      r"sliding_window=4096 is not supported .* set \"sliding_window\": null",
    ),
    ({"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling.factor is missing"),
    (
      {"architectures": ["MixtralForCausalLM"], "sliding_window": 4096},
      r"sliding_window=4096 is not supported .* set \"sliding_window\": null",
    ),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 1}, r"1 expert\(s\); a MoE model needs at least 2"),
  ],
)
def test_unsupported_variants_are_one_line_naming_the_field(change, fragment):
  with pytest.raises(InputError, match=fragment) as error:
    model_settings_from_hf({**LLAMA_3_2_1B, **change}, "config.json")
  assert "\n" not in str(error.value)


def _copy(converted, tmp_path) -> str:
  """The row's transformers folder copied, for a test that edits its config.json."""
  return shutil.copytree(converted.hf_path, str(tmp_path / "hf"))


def test_a_rope_type_the_checkpoint_does_not_have_stops_at_start(tmp_path, converted):
  with pytest.raises(InputError, match="rope_type=default was given but .*config.json has llama3.1"):
    convert_hf.to_maxlite(converted("llama3.2_tied").hf_path, str(tmp_path / "ml"), ["rope_type=default"])
  assert not os.path.exists(tmp_path / "ml")


def test_moe_layers_mixed_with_dense_layers_are_refused(tmp_path, converted):
  path = _copy(converted("qwen3_moe"), tmp_path)
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({**hf, "mlp_only_layers": [1]}, f)
  with pytest.raises(InputError, match="mlp_only_layers mix dense and MoE layers"):
    convert_hf.to_maxlite(path, str(tmp_path / "ml"), [])


# Totals published for the Hugging Face checkpoints (safetensors parameter counts on the Hub).
PUBLISHED_PARAMETERS = {
  "llama3.1-8b": 8_030_261_248,
  "llama3.1-70b": 70_553_706_496,
  "llama3.2-1b": 1_235_814_400,
  "llama3.2-3b": 3_212_749_824,
  "qwen2.5-7b": 7_615_616_512,
  "qwen3-0.6b": 596_049_920,
  "qwen3-8b": 8_190_735_360,
  "qwen3-30b-a3b": 30_532_122_624,
  "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize("model_name", list(PUBLISHED_PARAMETERS))
def test_model_configs_have_the_published_parameter_count_and_transformers_agrees(model_name):
  from support.config import make_config

  from MaxLite.models.hf_layout import hf_config_from_model

  config = make_config(f"model_name={model_name}")
  assert config.num_params == PUBLISHED_PARAMETERS[model_name]
  hf = hf_config_from_model(config)
  hf_config = transformers.AutoConfig.for_model(**hf)
  with torch.device("meta"):  # shapes only: no memory for 70B
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
  assert type(model).__name__ == hf["architectures"][0]
  assert sum(p.numel() for p in model.parameters()) == config.num_params


@pytest.mark.parametrize(
  "model_name, overrides",
  [
    ("llama3.1-8b", ()),  # llama3 scaling with pairs in all three bands (kept, blended, stretched)
    ("llama3.2-1b", ()),
    ("qwen3-8b", ()),
    ("qwen3-8b", ("rope_type=yarn", "rope_factor=4", "original_max_position_embeddings=32768")),  # Qwen3's long context
    (
      "llama3.1-8b",
      ("rope_type=yarn", "rope_factor=40", "original_max_position_embeddings=4096", "rope_truncate=false"),
    ),
  ],
)
def test_rope_frequencies_equal_transformers(model_name, overrides):
  from support.config import make_config
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  from MaxLite.layers.rope import rope_frequencies
  from MaxLite.models.hf_layout import hf_config_from_model

  config = make_config(f"model_name={model_name}", *overrides)
  hf = hf_config_from_model(config)
  kind = (hf["rope_scaling"] or {}).get("rope_type", "default")
  hf_config = transformers.AutoConfig.for_model(**hf)
  if kind == "default":
    expected, scale = (
      1.0 / (config.rope_max_timescale ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)),
      1.0,
    )
  else:
    expected, scale = ROPE_INIT_FUNCTIONS[kind](hf_config)
  ours, our_scale = rope_frequencies(config)
  np.testing.assert_allclose(ours, expected.numpy(), rtol=2.5e-7, atol=0)  # one float32 ulp
  assert our_scale == pytest.approx(scale, rel=1e-12)
  if kind == "llama3":
    wavelength = 2 * np.pi / expected.numpy()
    original = config.original_max_position_embeddings
    assert (wavelength < original / 4).any() and (wavelength > original).any()
    assert ((wavelength > original / 4) & (wavelength < original)).any()


def test_config_json_that_does_not_fit_the_weights_is_one_line(tmp_path, converted):
  path = _copy(converted("qwen3_tied"), tmp_path)  # head_dim 24
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  del hf["head_dim"]  # Qwen3's default is 128, not hidden / heads
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f)
  with pytest.raises(InputError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape \(96, 64\)"):
    convert_hf.to_maxlite(path, str(tmp_path / "ml"), [])


def test_loading_drops_no_parameter_and_exports_no_foreign_bos(converted):
  from MaxLite.cli.errors import CheckpointError

  converted = converted("qwen3_tied")
  step_dir = converted.step_dir
  with pytest.raises(CheckpointError, match=r"has 'params.decoder.layers.self_attention.key_norm.scale' which"):
    maxlite_params(maxlite_config(step_dir, "use_qk_norm=false"), step_dir)
  # No tokenizer given and the shipped one does not fit this model: no BOS/EOS ids rather than its 1 and 2.
  with open(os.path.join(converted.export_path, "config.json")) as f:
    exported = json.load(f)
  assert exported["bos_token_id"] is None and exported["eos_token_id"] is None
  assert exported["max_position_embeddings"] == 128  # config.json's, kept through MaxLite


@pytest.mark.parametrize("scan_layers", ["true", "false"])
def test_fused_projections_import_and_export_exactly(tmp_path, scan_layers):
  """fused_qkv / fused_mlp hold the same weights in one kernel each: transformers' logits, an exact export."""
  settings = dict(SMALL, num_key_value_heads=SMALL["num_attention_heads"], rope_parameters={"rope_theta": 10000.0})
  model, path = tiny_hf_model(str(tmp_path / "hf"), "Qwen2ForCausalLM", "Qwen2Config", settings)  # MHA, q/k/v biases
  fused = ["fused_qkv=true", "fused_mlp=true", f"scan_layers={scan_layers}"]
  step_dir = convert_hf.to_maxlite(path, str(tmp_path / "ml"), fused)
  config = maxlite_config(step_dir)
  assert config.fused_qkv and config.fused_mlp  # taken from the checkpoint
  params = maxlite_params(config, step_dir)
  layer = params["decoder"]["layers"] if scan_layers == "true" else params["decoder"]["layers_0"]
  assert set(layer["self_attention"]) == {"qkv_proj", "out"} and set(layer["mlp"]) == {"wi", "wo"}
  ids = token_ids(model.config.vocab_size)
  with torch.no_grad():
    expected = model(torch.tensor(ids)).logits.numpy()
  assert np.abs(maxlite_logits(config, params, ids) - expected).max() <= 2e-5
  convert_hf.to_hf(step_dir, str(tmp_path / "back"), [])
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
  for name, tensor in reloaded.state_dict().items():
    assert torch.equal(tensor, model.state_dict()[name]), name
