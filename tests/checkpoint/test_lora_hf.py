"""LoRA <-> PEFT: a MaxLite LoRA step exports as merged weights plus a PEFT adapter folder, and transformers (with
peft) gives MaxLite's logits for both; an adapter made by peft loads into MaxLite with peft's logits, and goes back
to peft unchanged, in every family (Llama, Gemma 3, DeepSeek-V3), scanned and unscanned."""

import re

import jax
import numpy as np
import pytest
from flax.linen import partitioning as nn_partitioning
from support.config import first_devices, make_config
from support.hf import SEQ, hf_deepseek, hf_gemma3, hf_model, maxlite_logits, token_ids, transformers_logits
from support.lora import ATTENTION_ONLY, LORA, lora_logits

from MaxLite.checkpoint import hf as convert_hf
from MaxLite.checkpoint import lora_peft, lora_steps
from MaxLite.checkpoint.safetensors_io import read_file
from MaxLite.cli.errors import CheckpointError
from MaxLite.layers import lora
from MaxLite.models import build
from MaxLite.parallel import sharding as sharding_lib
from MaxLite.parallel.mesh import create_mesh
from MaxLite.training.train_state import model_params
from MaxLite.training.trainer import train

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("qwix")

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# DeepSeek: MLA's projections, q_b_proj / q_proj and kv_a_proj_with_mqa holding RoPE rows MaxLite keeps in
# rotate-half order. Not its MLPs: peft 0.21 on transformers 5 turns every gate/up/down_proj target of a DeepseekV3
# model into one on the routed experts' fused tensors (huggingface/peft#3711), so it puts no adapter on the dense MLP
# or the shared experts.
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
FAMILIES = {  # transformers model maker, its settings, peft's target modules, MaxLite's settings
  "llama": (hf_model, {}, PROJECTIONS, ()),
  "gemma3": (hf_gemma3, {}, PROJECTIONS, ()),
  "deepseek": (hf_deepseek, {}, MLA, (ATTENTION_ONLY,)),
  "deepseek_no_q_lora": (hf_deepseek, {"q_lora_rank": None}, ["q_proj", *MLA[2:]], (ATTENTION_ONLY,)),
}


@pytest.mark.slow
@pytest.mark.parametrize("family, scan_layers", [("llama", "true"), ("llama", "false"), ("deepseek", "true")])
def test_a_lora_step_exports_merged_weights_and_a_peft_adapter_with_maxlite_logits(
  tmp_path, family, scan_layers, monkeypatch
):
  """DeepSeek: a LoRA run with routed_bias_update_rate > 0 trains (the routing bias stays as the frozen base has it),
  and its MLA adapters, RoPE rows included, export with MaxLite's logits."""
  make, overrides, _, maxlite = FAMILIES[family]
  base_model, hf_path = make(tmp_path, **overrides)
  base_step = convert_hf.to_maxlite(hf_path, str(tmp_path / "base"), [f"scan_layers={scan_layers}"])
  run = (*LORA, *maxlite, f"load_parameters_path={base_step}", f"max_target_length={SEQ}", "learning_rate=1e-2")
  run += ("routed_bias_update_rate=0.01",) if family == "deepseek" else ()
  run += ("dataset_type=synthetic", "per_device_batch_size=2", "enable_tensorboard=false")
  train(make_config(*run, "steps=3", f"base_output_directory={tmp_path}", "run_name=lora"), first_devices(1))
  step = str(tmp_path / "lora" / "checkpoints" / "3")
  files = convert_hf.to_hf(step, str(tmp_path / "export"), [])
  assert "adapter/adapter_config.json" in files and "adapter/adapter_model.safetensors" in files
  assert "base/config.json" in files and not any(f.startswith("base/adapter") for f in files)

  ids = token_ids(base_model.config.vocab_size)
  ours, _ = lora_logits(make_config(*run, f"lora_restore_path={step}"), ids)
  base_logits = transformers_logits(base_model, ids)  # before peft puts the adapter into base_model
  merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), attn_implementation="eager")
  with_adapter = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "export" / "adapter")).eval()
  # The adapter folder alone, offline and from another working directory: its config names the base's folder.
  import huggingface_hub

  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
  (tmp_path / "elsewhere").mkdir()
  monkeypatch.chdir(tmp_path / "elsewhere")
  auto = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "export" / "adapter")).eval()
  plain = make_config(f"load_parameters_path={step}", f"max_target_length={SEQ}")
  device = jax.sharding.SingleDeviceSharding(first_devices(1)[0])
  abstract = build.abstract_parameters(plain)
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
  merged_in_maxlite = maxlite_logits(plain, lora_steps.load_params(step, target), ids)
  for name, got in (
    ("transformers, merged export", transformers_logits(merged, ids)),
    ("transformers + peft adapter", transformers_logits(with_adapter, ids)),
    ("peft's AutoPeftModelForCausalLM on the adapter folder", transformers_logits(auto, ids)),
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
  base_logits = transformers_logits(base_model, ids)
  torch.manual_seed(1)
  made = peft.get_peft_model(base_model, settings).eval()
  made.save_pretrained(str(tmp_path / "adapter"))
  expected = transformers_logits(made, ids)
  run = (*LORA, f"load_parameters_path={base_step}", f"max_target_length={SEQ}", "per_device_batch_size=2")
  ours, state = lora_logits(make_config(*run, f"hf_lora_adapter_path={tmp_path / 'adapter'}"), ids)
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
    lora_logits(make_config(*run, f"hf_lora_adapter_path={tmp_path / 'other_adapter'}"), ids)
  assert "\n" not in str(caught.value)


@pytest.mark.slow
# Every family scanned and unscanned, but DeepSeek unscanned only without q_lora: its q_a/q_b mapping is the scanned
# row's, and the unscanned layer stacks (dense and MoE) with their permuted RoPE rows are deepseek_no_q_lora's.
@pytest.mark.parametrize(
  "family,scan_layers",
  [(family, scan) for family in FAMILIES for scan in ("true", "false") if (family, scan) != ("deepseek", "false")],
)
def test_peft_adapters_load_and_export_with_peft_s_logits_in_every_family(tmp_path, family, scan_layers):
  """A peft adapter on every projection of a converted transformers model: MaxLite's LoRA model gives peft's logits,
  and MaxLite's adapters exported again are peft's tensors exactly, which peft on a fresh base turns into MaxLite's
  logits. DeepSeek's RoPE rows are stored permuted in MaxLite, and its adapters' B rows must move with them."""
  make, overrides, targets, maxlite = FAMILIES[family]
  base_model, hf_path = make(tmp_path, **overrides)
  base_step = convert_hf.to_maxlite(hf_path, str(tmp_path / "base"), [f"scan_layers={scan_layers}"])
  ids = token_ids(base_model.config.vocab_size)
  base_logits = transformers_logits(base_model, ids)
  torch.manual_seed(1)
  settings = peft.LoraConfig(r=4, lora_alpha=12, target_modules=targets, init_lora_weights=False)
  made = peft.get_peft_model(base_model, settings).eval()
  made.save_pretrained(str(tmp_path / "adapter"))
  expected = transformers_logits(made, ids)
  run = (*LORA, *maxlite, f"load_parameters_path={base_step}", f"max_target_length={SEQ}", "per_device_batch_size=2")
  config = make_config(*run, f"hf_lora_adapter_path={tmp_path / 'adapter'}")
  ours, state = lora_logits(config, ids)
  print(
    f"{family}: MaxLite vs peft {np.abs(ours - expected).max():.2e}, the adapter's own effect "
    f"{np.abs(expected - base_logits).max():.2e}"
  )
  assert np.abs(ours - expected).max() <= 1e-4
  assert np.abs(expected - base_logits).max() > 1e-2  # the adapter is not a no-op

  adapters, base = lora.split(jax.tree.map(np.asarray, model_params(state)))
  folder = str(tmp_path / "export" / "adapter")
  lora_peft.write_adapter(folder, config, base, adapters, rank=4, alpha=12.0)
  original = read_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  exported = read_file(f"{folder}/adapter_model.safetensors")
  assert set(exported) == set(original)
  for name, tensor in original.items():
    np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
  fresh = transformers.AutoModelForCausalLM.from_pretrained(hf_path, attn_implementation="eager")
  back = peft.PeftModel.from_pretrained(fresh, folder).eval()
  assert np.abs(transformers_logits(back, ids) - ours).max() <= 1e-4
