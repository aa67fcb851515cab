"""LoRA <-> PEFT: a MaxLite LoRA step exports as merged weights plus a PEFT adapter folder, and transformers (with
peft) gives MaxLite's logits for both; an adapter made by peft loads into MaxLite with peft's logits."""

import re

import jax
import numpy as np
import pytest
from conftest import first_devices, make_config
from flax.linen import partitioning as nn_partitioning
from test_hf_interop import SEQ, hf_model, maxlite_logits, token_ids

from MaxLite import builder
from MaxLite.checkpoint import hf as convert_hf
from MaxLite.checkpoint import lora_steps
from MaxLite.cli.errors import CheckpointError
from MaxLite.parallel import sharding as sharding_lib
from MaxLite.parallel.mesh import create_mesh
from MaxLite.training.train_state import model_params
from MaxLite.training.trainer import initial_state, train

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("qwix")

LORA = ("enable_lora=true", "lora_rank=4", "lora_alpha=12")  # scale 3: a mix-up of alpha/r cannot pass
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_logits(config, ids):
  """MaxLite's LoRA model (adapters applied by Qwix, not merged) at the run's starting state, and that state."""
  mesh = create_mesh(config, first_devices(1))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    pieces = builder.training(config, mesh)
    state, _ = initial_state(config, pieces)
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    logits = pieces.model.apply({"params": model_params(state)}, ids, pos, np.ones_like(ids))
  return np.asarray(logits), state


def _transformers_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", ["true", "false"])
def test_a_lora_step_exports_merged_weights_and_a_peft_adapter_with_maxlite_logits(tmp_path, scan_layers):
  base_model, hf_path = hf_model(tmp_path)
  base_step = convert_hf.to_maxlite(hf_path, str(tmp_path / "base"), [f"scan_layers={scan_layers}"])
  run = (*LORA, f"load_parameters_path={base_step}", f"max_target_length={SEQ}", "learning_rate=1e-2")
  run += ("dataset_type=synthetic", "per_device_batch_size=2", "enable_tensorboard=false")
  train(make_config(*run, "steps=3", f"base_output_directory={tmp_path}", "run_name=lora"), first_devices(1))
  step = str(tmp_path / "lora" / "checkpoints" / "3")
  files = convert_hf.to_hf(step, str(tmp_path / "export"), [])
  assert "adapter/adapter_config.json" in files and "adapter/adapter_model.safetensors" in files

  ids = token_ids(base_model.config.vocab_size)
  ours, _ = _lora_logits(make_config(*run, f"lora_restore_path={step}"), ids)
  base_logits = _transformers_logits(base_model, ids)  # before peft puts the adapter into base_model
  merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
  with_adapter = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "export" / "adapter")).eval()
  plain = make_config(f"load_parameters_path={step}", f"max_target_length={SEQ}")
  device = jax.sharding.SingleDeviceSharding(first_devices(1)[0])
  abstract = builder.abstract_parameters(plain)
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
  merged_in_maxlite = maxlite_logits(plain, lora_steps.load_params(step, target), ids)
  for name, got in (
    ("transformers, merged export", _transformers_logits(merged, ids)),
    ("transformers + peft adapter", _transformers_logits(with_adapter, ids)),
    ("MaxLite, merged step", merged_in_maxlite),
  ):
    print(f"{name}: max abs difference from MaxLite's LoRA model {np.abs(got - ours).max():.2e}")
    assert np.abs(got - ours).max() <= 1e-4, name
  assert np.abs(ours - base_logits).max() > 1e-3  # the adapters did train


@pytest.mark.slow
def test_an_adapter_made_by_peft_loads_with_peft_s_logits(tmp_path):
  base_model, hf_path = hf_model(tmp_path)
  base_step = convert_hf.to_maxlite(hf_path, str(tmp_path / "base"), [])
  settings = peft.LoraConfig(r=4, lora_alpha=12, target_modules=PROJECTIONS, init_lora_weights=False)
  ids = token_ids(base_model.config.vocab_size)
  base_logits = _transformers_logits(base_model, ids)
  torch.manual_seed(1)
  made = peft.get_peft_model(base_model, settings).eval()
  made.save_pretrained(str(tmp_path / "adapter"))
  expected = _transformers_logits(made, ids)
  run = (*LORA, f"load_parameters_path={base_step}", f"max_target_length={SEQ}", "per_device_batch_size=2")
  ours, state = _lora_logits(make_config(*run, f"hf_lora_adapter_path={tmp_path / 'adapter'}"), ids)
  print(f"max abs difference from peft: {np.abs(ours - expected).max():.2e}")
  assert np.abs(ours - expected).max() <= 1e-4
  assert np.abs(expected - base_logits).max() > 1e-2  # the adapter is not a no-op
  # decode.py with the adapter: greedy tokens through the KV cache equal peft's generate.
  from MaxLite.inference import generate

  decoding = make_config(
    *run, f"hf_lora_adapter_path={tmp_path / 'adapter'}", "max_prefill_predict_length=8", "max_decode_steps=10"
  )
  mesh = create_mesh(decoding, first_devices(1))
  prompt = [1, 52, 7, 300, 12]
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(decoding)):
    ours_tokens, _ = generate.generate(decoding, generate.load_params(decoding, mesh), [prompt], eos_id=None)
  with torch.no_grad():
    theirs = made.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)
  assert ours_tokens[0] == theirs[0, len(prompt) :].tolist()

  # An adapter for another base (a wider MLP) is one line naming the tensor and both shapes.
  other, _ = hf_model(tmp_path, name="other", intermediate_size=96)
  peft.get_peft_model(other, settings).save_pretrained(str(tmp_path / "other_adapter"))
  with pytest.raises(CheckpointError, match=re.escape("has shape [96, 4], this model needs [160, 4]")) as caught:
    _lora_logits(make_config(*run, f"hf_lora_adapter_path={tmp_path / 'other_adapter'}"), ids)
  assert "\n" not in str(caught.value)
