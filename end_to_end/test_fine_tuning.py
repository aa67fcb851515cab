"""README's "Fine-tune Qwen3-0.6B on chats, then DPO", command for command, on a tiny Qwen3-shaped model with the
shipped ChatML tokenizer; and SFT on the shipped chats, then DPO on the shipped preference pairs from its checkpoint,
as real train.py processes: each run killed and resumed equals the uninterrupted run bit for bit, and 2 processes x
4 devices give the losses of 1 process x 8 devices."""

import json
import os
import re
import shutil
import signal

import numpy as np
import procs
import pytest
from procs import output_of, readme_commands

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out

CHAT = (
  *procs.TINY,
  "max_target_length=256",
  "vocab_size=4224",
  "enable_tensorboard=false",
  "per_device_batch_size=1",
  "ici_fsdp_parallelism=4",
  "ici_tensor_parallelism=2",
  "steps=6",
  "tokenizer_type=huggingface",
  "tokenizer_path=assets/tokenizer/chat",
  "use_chat_template=true",
  "grain_file_type=jsonl",
  "grain_eval_files=",
)
SFT = (
  "use_sft=true",
  "sft_train_on_completion_only=true",
  "grain_train_files=assets/post_training/chats-train.jsonl",
)
DPO = ("use_dpo=true", "grain_train_files=assets/post_training/preferences-train.jsonl", "learning_rate=1e-3")


def _killed_and_resumed(tmp_path, args, run_name, kill_after):
  """{step: loss} of a single 8-device process killed after step `kill_after` (checkpoints every 2 steps) and run
  again to the end."""
  command = procs.train_command(*args, f"run_name={run_name}", "enable_checkpointing=true", "checkpoint_period=2")
  metrics, log = str(tmp_path / run_name / "metrics.jsonl"), str(tmp_path / f"{run_name}.log")
  proc = procs.start(command, log, devices=8)
  procs.wait_for_step(proc, metrics, kill_after, log)
  procs.kill_group(proc, signal.SIGKILL)
  assert procs.run(command, log, devices=8) == 0, procs.tail(log)
  resumed = procs.losses(procs.resumed_rows(metrics, log))
  assert min(resumed) <= kill_after + 1 and max(resumed) == 6
  return resumed


def _straight(tmp_path, args, run_name, processes=1):
  log = str(tmp_path / f"{run_name}.log")
  if processes == 1:
    command = procs.train_command(*args, f"run_name={run_name}", "enable_checkpointing=true", "checkpoint_period=6")
    assert procs.run(command, log, devices=8) == 0, procs.tail(log)
  else:
    command = procs.launch_command(processes, 8 // processes, *args, f"run_name={run_name}")
    assert procs.run(command, log) == 0, procs.tail(log)
  rows = procs.metric_rows(str(tmp_path / run_name / "metrics.jsonl"))
  return procs.losses(rows), rows


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
  """The uninterrupted SFT run on 1 process x 8 devices; its last checkpoint starts DPO (and is its reference)."""
  root = tmp_path_factory.mktemp("post_training")
  args = (*CHAT, *SFT, f"base_output_directory={root}")
  return root, args, _straight(root, args, "sft_one")


@pytest.mark.parametrize("mode", ["sft", "dpo"])
def test_kill_resume_and_two_processes(sft_run, mode):
  root, args, (one, rows) = sft_run
  if mode == "dpo":
    args = (*CHAT, *DPO, f"base_output_directory={root}", f"load_parameters_path={root}/sft_one/checkpoints/6")
    one, rows = _straight(root, args, "dpo_one")
    np.testing.assert_allclose(one[1], np.log(2), rtol=1e-5)  # step 1: the policy is still the reference
    assert all(0 <= r["rewards/accuracies"] <= 1 and r["pairs"] > 0 for r in rows if "loss" in r)
  assert sorted(one) == list(range(1, 7))
  assert all(r["trained_tokens"] > 0 for r in rows if "loss" in r)
  resumed = _killed_and_resumed(root, args, f"{mode}_killed", kill_after=3)
  assert resumed == {s: one[s] for s in resumed}  # bit for bit
  two, _ = _straight(root, args, f"{mode}_two", processes=2)
  # Processes with another device count round differently in XLA's CPU code: rel 1e-5, not bit for bit.
  np.testing.assert_allclose([two[s] for s in sorted(one)], [one[s] for s in sorted(one)], rtol=1e-5)


def qwen3_folder(path):
  """What a user downloads, in small: config.json + safetensors of a Qwen3, and its tokenizer files with the chat
  template (here the shipped ChatML tokenizer: EOS <|im_end|>, no BOS, as Qwen's)."""
  tokenizer_dir = os.path.join(procs.REPO, "assets", "tokenizer", "chat")
  with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
    vocab = json.load(f)["model"]["vocab"]
  config = transformers.Qwen3Config(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    eos_token_id=vocab["<|im_end|>"],
    bos_token_id=None,
  )
  torch.manual_seed(0)
  transformers.Qwen3ForCausalLM(config).save_pretrained(path)
  for name in os.listdir(tokenizer_dir):
    shutil.copy(os.path.join(tokenizer_dir, name), path)
  return config


def test_readme_walkthrough_sft_dpo_decode_export(tmp_path):
  """The README's five commands as written, pointed at a tiny Qwen3 folder, with (appended, later keys win) what a
  laptop needs: float32, a few steps of 256 tokens."""
  hf, out = str(tmp_path / "Qwen3-0.6B"), str(tmp_path / "export")
  config = qwen3_folder(hf)
  places = {
    "Qwen3-0.6B": hf,
    "ckpt/qwen3-0.6b": str(tmp_path / "ckpt"),
    "outputs/qwen3-sft/checkpoints/200": str(tmp_path / "qwen3-sft" / "checkpoints" / "4"),
    "outputs/qwen3-dpo/checkpoints/100": str(tmp_path / "qwen3-dpo" / "checkpoints" / "4"),
    "qwen3-dpo-hf": out,
  }
  pattern = re.compile("|".join(re.escape(k) for k in sorted(places, key=len, reverse=True)))
  laptop = {
    "convert_hf.py": ["weight_dtype=float32"],
    "train.py": ["dtype=float32", "weight_dtype=float32", "steps=4", "max_target_length=256", "per_device_batch_size=2"]
    + [f"base_output_directory={tmp_path}", "eval_interval=4", "eval_steps=2", "learning_rate=1e-3"],
    "decode.py": ["max_target_length=64", "max_prefill_predict_length=16", "max_decode_steps=8", "jax_cache_dir="],
  }
  commands = readme_commands("### Fine-tune Qwen3-0.6B on chats, then DPO")
  assert [c[1] for c in commands] == [
    "MaxLite/convert_hf.py",
    "MaxLite/train.py",
    "MaxLite/train.py",
    "MaxLite/decode.py",
    "MaxLite/convert_hf.py",
  ]
  printed = {}
  for python, script, *args in commands:
    assert python == "python"
    args = [pattern.sub(lambda m: places[m.group(0)], a) for a in args]
    extra = [] if "to_hf" in args else laptop[os.path.basename(script)]
    printed[script] = output_of([script, *args, *extra])

  sft = procs.metric_rows(str(tmp_path / "qwen3-sft" / "metrics.jsonl"))
  dpo = procs.metric_rows(str(tmp_path / "qwen3-dpo" / "metrics.jsonl"))
  assert [r["step"] for r in sft if "loss" in r] == [1, 2, 3, 4] and all(r["trained_tokens"] > 0 for r in sft[:4])
  assert any("eval_loss" in r for r in sft)
  np.testing.assert_allclose(dpo[0]["loss"], np.log(2), rtol=1e-5)  # step 1: the policy is the reference
  evals = [r for r in dpo if "eval_rewards/accuracies" in r]
  assert evals and {"eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins"} <= set(evals[0])

  prompt = 'The section "Lists" says:'
  ours = printed["MaxLite/decode.py"].split(f"[0] {prompt}", 1)[1].rstrip("\n")
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tok = transformers.AutoTokenizer.from_pretrained(out)
  assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.eos_token_id == config.eos_token_id
  messages = [{"role": "user", "content": "Tell me about Lists."}]
  assert tok.apply_chat_template(messages, tokenize=False).startswith("<|im_start|>system")  # the template came along
  original = transformers.AutoModelForCausalLM.from_pretrained(hf)
  assert not torch.equal(model.model.embed_tokens.weight, original.model.embed_tokens.weight)  # training moved it
  ids = tok(prompt, add_special_tokens=False)["input_ids"]  # no BOS: the tokenizer has none
  with torch.no_grad():
    generated = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=config.eos_token_id)
  assert tok.decode([t for t in generated[0, len(ids) :].tolist() if t != config.eos_token_id]) == ours
