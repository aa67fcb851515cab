"""Hugging Face Llama <-> MaxLite: logit parity with transformers, exact round trips, clear bad-input errors."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from conftest import BASE_YML, first_devices, make_config

from MaxLite.checkpoint import hf as convert_hf
from MaxLite.checkpoint import manager as checkpointing
from MaxLite.config import load_config
from MaxLite.decode import generate
from MaxLite.errors import InputError
from MaxLite.layers.decoder import Transformer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 24


def hf_model(tmp_path, name="hf", shard=False, **overrides):
  """A small random LlamaForCausalLM built with transformers' own config class, saved as safetensors."""
  settings = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
  )
  settings.update(overrides)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).eval()
  with torch.no_grad():  # norm scales away from 1, so a mixed-up norm cannot pass
    for name_, param in model.named_parameters():
      if "norm" in name_:
        param.add_(0.1 * torch.randn_like(param))
  path = str(tmp_path / name)
  model.save_pretrained(path, **({"max_shard_size": "100KB"} if shard else {}))
  return model, path


def maxlite_config(step_dir, *overrides):
  return load_config(
    [BASE_YML, f"load_parameters_path={step_dir}", f"max_target_length={SEQ}", *overrides],
    num_devices=1,
    num_slices=1,
    process_count=1,
  )


def maxlite_params(config, step_dir):
  device = jax.sharding.SingleDeviceSharding(first_devices(1)[0])
  abstract = convert_hf._abstract_params(config)  # pylint: disable=protected-access
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
  return checkpointing.load_params(step_dir, target)


def token_ids(vocab, batch=2):
  return np.random.default_rng(1).integers(0, vocab, (batch, SEQ))


def maxlite_logits(config, params, ids):
  pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
  return np.asarray(Transformer(config).apply({"params": params}, ids, pos, np.ones_like(ids)))


@pytest.mark.parametrize("scan_layers", ["true", "false"])
@pytest.mark.parametrize(
  "variant",
  [
    dict(),  # GQA: 2 kv heads for 4 query heads
    dict(tie_word_embeddings=True, num_key_value_heads=4, rope_theta=500000.0),
    dict(num_key_value_heads=1, rope_theta=1234.5, shard=True),  # MQA, sharded safetensors + index
  ],
  ids=["gqa", "tied_mha_theta5e5", "mqa_sharded"],
)
def test_converted_model_gives_the_transformers_logits(tmp_path, scan_layers, variant):
  model, path = hf_model(tmp_path, **variant)
  if variant.get("shard"):
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
  step_dir = convert_hf.to_maxlite(path, str(tmp_path / "ml"), [f"scan_layers={scan_layers}"])
  config = maxlite_config(step_dir)  # no model arguments: they come from the converted checkpoint
  assert config.scan_layers == (scan_layers == "true") and config.base_num_kv_heads == model.config.num_key_value_heads
  ids = token_ids(model.config.vocab_size)
  with torch.no_grad():
    expected = model(torch.tensor(ids)).logits.numpy()
  got = maxlite_logits(config, maxlite_params(config, step_dir), ids)
  print(f"max abs logit difference: {np.abs(got - expected).max():.2e}")
  assert np.abs(got - expected).max() <= 1e-4


def test_hf_to_maxlite_to_hf_gives_the_original_tensors(tmp_path):
  model, path = hf_model(tmp_path)
  step_dir = convert_hf.to_maxlite(path, str(tmp_path / "ml"), [])
  files = convert_hf.to_hf(step_dir, str(tmp_path / "back"), [])
  assert "config.json" in files
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
  original = model.state_dict()
  assert set(reloaded.state_dict()) == set(original)
  for name, tensor in reloaded.state_dict().items():
    assert torch.equal(tensor, original[name]), name


def _expect_error(fragment, *args):
  with pytest.raises(InputError, match=fragment) as error:
    convert_hf.to_maxlite(*args)
  assert "\n" not in str(error.value)


def test_bad_inputs_are_one_clear_line(tmp_path):
  _, path = hf_model(tmp_path)
  _expect_error("no config.json there", str(tmp_path / "nowhere"), str(tmp_path / "o1"), [])
  no_weights = str(tmp_path / "no_weights")
  os.makedirs(no_weights)
  shutil.copy(os.path.join(path, "config.json"), no_weights)
  _expect_error("no model.safetensors or model.safetensors.index.json", no_weights, str(tmp_path / "o2"), [])
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  for change, fragment in (
    ({"architectures": ["MixtralForCausalLM"]}, "architecture 'MixtralForCausalLM' is not supported"),
    (
      {"intermediate_size": 128},
      r"'decoder.layers.mlp.wi_0.kernel' has shape \(3, 64, 160\) "
      r"but the model from config.json expects \(3, 64, 128\)",
    ),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
  ):
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump({**hf, **change}, f)
    _expect_error(fragment, path, str(tmp_path / "o3"), [])
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f)
  _expect_error("base_emb_dim=32 was given but .* has 64", path, str(tmp_path / "o4"), ["base_emb_dim=32"])
  assert not os.path.exists(tmp_path / "o3") and not os.path.exists(tmp_path / "o4")
  convert_hf.to_maxlite(path, str(tmp_path / "o5"), [])
  _expect_error("already exists", path, str(tmp_path / "o5"), [])


def test_maxlite_trained_model_exports_to_transformers(tmp_path):
  """A tiny model trained by MaxLite, exported: transformers gives MaxLite's logits."""
  from MaxLite.training.trainer import train

  config = make_config(
    "model_name=tiny",
    "dataset_type=synthetic",
    "steps=2",
    f"max_target_length={SEQ}",
    "enable_checkpointing=true",
    f"base_output_directory={tmp_path}",
    "run_name=t",
    "enable_tensorboard=false",
  )
  train(config, first_devices(1))
  step_dir = str(tmp_path / "t" / "checkpoints" / "2")
  convert_hf.to_hf(step_dir, str(tmp_path / "hf"), [])
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
  loaded = maxlite_config(step_dir)
  ids = token_ids(loaded.vocab_size)
  with torch.no_grad():
    expected = model(torch.tensor(ids)).logits.numpy()
  params = maxlite_params(loaded, step_dir)
  assert np.abs(maxlite_logits(loaded, params, ids) - expected).max() <= 1e-4
  # Greedy decoding with MaxLite's KV cache picks the same tokens as transformers' generate.
  prompt = [1, 523, 77, 4096, 12]
  decoded = maxlite_config(step_dir, "max_prefill_predict_length=8", "max_decode_steps=12")
  ours, _ = generate(decoded, params, [prompt], eos_id=2)
  with torch.no_grad():
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=0)[
      0, len(prompt) :
    ].tolist()
  assert ours[0] == theirs, (ours[0], theirs)


def test_command_line(tmp_path):
  import subprocess
  import sys

  script = os.path.join(os.path.dirname(BASE_YML), "..", "MaxLite", "convert_hf.py")
  _, path = hf_model(tmp_path)
  run = lambda *a: subprocess.run([sys.executable, script, *a], capture_output=True, text=True, timeout=300)
  done = run("to_maxlite", f"--hf_path={path}", f"--output_path={tmp_path / 'ml'}", "scan_layers=false")
  assert done.returncode == 0 and f"load_parameters_path={tmp_path / 'ml' / '0'}" in done.stdout, done.stderr[-2000:]
  back = run("to_hf", f"--checkpoint_path={tmp_path / 'ml' / '0'}", f"--output_path={tmp_path / 'hf2'}")
  assert back.returncode == 0 and os.path.isfile(tmp_path / "hf2" / "model.safetensors"), back.stderr[-2000:]
  for args, fragment in (
    (("sideways",), "invalid choice: 'sideways'"),
    (("to_hf",), "--checkpoint_path=... is required"),
  ):
    bad = run(*args)
    assert bad.returncode == 2 and fragment in bad.stderr and "Traceback" not in bad.stderr
