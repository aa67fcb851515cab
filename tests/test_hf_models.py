"""Llama 3.1/3.2 (rope scaling), YaRN, Qwen2.5 (q/k/v biases), Qwen3 (q/k norm) and Qwen3-MoE from transformers:
converted weights give transformers' logits and greedy tokens, and export back bit for bit."""

import json
import os

import numpy as np
import pytest
from test_hf_interop import SMALL, maxlite_config, maxlite_logits, maxlite_params, token_ids

from MaxLite.checkpoint import hf as convert_hf
from MaxLite.checkpoint.hf_layout import model_settings_from_hf
from MaxLite.decode import generate
from MaxLite.errors import InputError

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


# The published config.json fields that decide the model (values from the Hugging Face Hub model cards' files).
LLAMA_3_2_1B = {
  "architectures": ["LlamaForCausalLM"],
  "hidden_size": 2048,
  "intermediate_size": 8192,
  "num_attention_heads": 32,
  "num_key_value_heads": 8,
  "head_dim": 64,
  "num_hidden_layers": 16,
  "vocab_size": 128256,
  "rms_norm_eps": 1e-05,
  "rope_theta": 500000.0,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
  },
  "tie_word_embeddings": True,
  "attention_bias": False,
  "mlp_bias": False,
  "hidden_act": "silu",
}


def test_published_llama_3_2_config_maps_to_the_shipped_model_config():
  from conftest import make_config

  settings = model_settings_from_hf(LLAMA_3_2_1B, "config.json")
  shipped = make_config("model_name=llama3.2-1b")
  for key, value in settings.items():
    assert getattr(shipped, key) == value, key


@pytest.mark.parametrize(
  "change, fragment",
  [
    ({"architectures": ["Gemma2ForCausalLM"]}, "architecture 'Gemma2ForCausalLM' is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type='longrope' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "mscale": 0.7}}, "rope_scaling.mscale is not supported"),
    ({"attention_bias": True}, "attention_bias=true is not supported for LlamaForCausalLM"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor is not supported"),
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
