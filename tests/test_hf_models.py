"""Llama 3.1/3.2 (rope scaling), YaRN, Qwen2.5 (q/k/v biases), Qwen3 (q/k norm), Qwen3-MoE and Mixtral from
transformers: converted weights give transformers' logits and greedy tokens, and export back bit for bit."""

import json
import os

import numpy as np
import pytest
from test_hf_interop import SMALL, maxlite_config, maxlite_logits, maxlite_params, token_ids

from MaxLite.checkpoint import hf as convert_hf
from MaxLite.checkpoint.hf_layout import model_settings_from_hf
from MaxLite.cli.errors import InputError
from MaxLite.decode import generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
VARIANTS = {
  # original context 16 < SEQ, so the scaled frequencies matter within the test's sequences
  "llama3.2_tied": ("Llama", dict(tie_word_embeddings=True), dict(LLAMA3_ROPE, original_max_position_embeddings=16)),
  "llama_yarn": ("Llama", dict(), dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)),
  "qwen2.5": ("Qwen2", dict(num_key_value_heads=1), dict(rope_type="default")),
  "qwen3_tied": ("Qwen3", dict(head_dim=24, tie_word_embeddings=True), dict(rope_type="default")),
  "qwen3_yarn": ("Qwen3", dict(head_dim=32), dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=12)),
  # cos/sin by the mscale / mscale_all_dim ratio (transformers' rule for any YaRN model), the softmax untouched
  "llama_yarn_mscales": (
    "Llama",
    dict(),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.4),
  ),
  "qwen3_moe": (
    "Qwen3Moe",
    dict(head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
    dict(rope_type="default"),
  ),
  "qwen3_moe_unnormalised": (
    "Qwen3Moe",
    dict(num_experts=4, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False),
    dict(rope_type="default"),
  ),
  # no q/k norm: exports as Mixtral; its router (mlp.gate.weight in transformers' modules) is perturbed too
  "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2), dict(rope_type="default")),
}


def hf_model(tmp_path, variant):
  """A small random model of the variant's architecture, built by transformers and saved as safetensors."""
  family, overrides, rope = VARIANTS[variant]
  config_class = getattr(transformers, f"{family}Config")
  config = config_class(**{**SMALL, "rms_norm_eps": 1e-6, **overrides}, rope_parameters={"rope_theta": 10000.0, **rope})
  torch.manual_seed(0)
  model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
  with torch.no_grad():  # norms away from 1, biases and router away from 0: a mixed-up tensor cannot pass
    for name, param in model.named_parameters():
      if "norm" in name or "bias" in name or "gate.weight" in name:
        param.add_(0.3 * torch.randn_like(param))
  path = str(tmp_path / variant)
  model.save_pretrained(path)
  return model, path


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_converted_model_matches_transformers_and_exports_back_exactly(tmp_path, variant):
  model, path = hf_model(tmp_path, variant)
  step_dir = convert_hf.to_maxlite(path, str(tmp_path / "ml"), [])
  config = maxlite_config(step_dir)
  params = maxlite_params(config, step_dir)
  ids = token_ids(model.config.vocab_size)
  with torch.no_grad():
    expected = model(torch.tensor(ids)).logits.numpy()
  diff = np.abs(maxlite_logits(config, params, ids) - expected).max()
  print(f"{variant}: max abs logit difference {diff:.2e}")
  assert diff <= 2e-5

  prompt = [3, 200, 17, 91, 5]
  decoding = maxlite_config(step_dir, "max_prefill_predict_length=8", "max_decode_steps=14")
  ours, _ = generate(decoding, params, [prompt], eos_id=None)
  with torch.no_grad():
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False, eos_token_id=None)
  assert ours[0] == theirs[0, len(prompt) :].tolist()

  convert_hf.to_hf(step_dir, str(tmp_path / "back"), [])
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
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
  from conftest import make_config

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


def test_a_rope_type_the_checkpoint_does_not_have_stops_at_start(tmp_path):
  _, path = hf_model(tmp_path, "llama3.2_tied")
  with pytest.raises(InputError, match="rope_type=default was given but .*config.json has llama3.1"):
    convert_hf.to_maxlite(path, str(tmp_path / "ml"), ["rope_type=default"])
  assert not os.path.exists(tmp_path / "ml")


def test_moe_layers_mixed_with_dense_layers_are_refused(tmp_path):
  _, path = hf_model(tmp_path, "qwen3_moe")
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
  from conftest import make_config

  from MaxLite.checkpoint.hf_layout import hf_config_from_model

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
  from conftest import make_config
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  from MaxLite.checkpoint.hf_layout import hf_config_from_model
  from MaxLite.layers.rope import rope_frequencies

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


def test_config_json_that_does_not_fit_the_weights_is_one_line(tmp_path):
  _, path = hf_model(tmp_path, "qwen3_tied")  # head_dim 24
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  del hf["head_dim"]  # Qwen3's default is 128, not hidden / heads
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f)
  with pytest.raises(InputError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape \(96, 64\)"):
    convert_hf.to_maxlite(path, str(tmp_path / "ml"), [])


def test_loading_drops_no_parameter_and_exports_no_foreign_bos(tmp_path):
  from MaxLite.cli.errors import CheckpointError

  _, path = hf_model(tmp_path, "qwen3_tied")
  step_dir = convert_hf.to_maxlite(path, str(tmp_path / "ml"), [])
  with pytest.raises(CheckpointError, match=r"has 'params.decoder.layers.self_attention.key_norm.scale' which"):
    maxlite_params(maxlite_config(step_dir, "use_qk_norm=false"), step_dir)
  # No tokenizer given and the shipped one does not fit this model: no BOS/EOS ids rather than its 1 and 2.
  convert_hf.to_hf(step_dir, str(tmp_path / "back"), [])
  with open(tmp_path / "back" / "config.json") as f:
    exported = json.load(f)
  assert exported["bos_token_id"] is None and exported["eos_token_id"] is None
  assert exported["max_position_embeddings"] == 128  # config.json's, kept through MaxLite


@pytest.mark.parametrize("scan_layers", ["true", "false"])
def test_fused_projections_import_and_export_exactly(tmp_path, scan_layers):
  """fused_qkv / fused_mlp hold the same weights in one kernel each: transformers' logits, an exact export."""
  family, overrides = "Qwen2", dict(num_key_value_heads=SMALL["num_attention_heads"])  # MHA with q/k/v biases
  config = transformers.Qwen2Config(**{**SMALL, **overrides}, rope_parameters={"rope_theta": 10000.0})
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(config).eval()
  with torch.no_grad():
    for name, param in model.named_parameters():
      if "bias" in name:
        param.add_(0.3 * torch.randn_like(param))
  model.save_pretrained(str(tmp_path / family))
  fused = ["fused_qkv=true", "fused_mlp=true", f"scan_layers={scan_layers}"]
  step_dir = convert_hf.to_maxlite(str(tmp_path / family), str(tmp_path / "ml"), fused)
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
