"""README's "Continue pretraining Llama 3.2 1B", command for command, on a small Llama-3.2-shaped model:
convert the HF folder, train with its tokenizer.json, decode, export back; transformers then loads the export and
its greedy continuation is the text decode.py printed."""

import json
import os
import re

import pytest
from procs import REPO, output_of, readme_commands

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402  (with transformers)

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out

VOCAB = 512
PROMPT = "The history of"


def corpus_documents():
  from array_record.python.array_record_module import ArrayRecordReader

  reader = ArrayRecordReader(os.path.join(REPO, "assets", "corpus", "train-00000-of-00004.array_record"))
  try:
    return [r.decode("utf-8") for r in reader.read(list(range(reader.num_records())))]
  finally:
    reader.close()


def parquet_shards(folder, documents, shards=2):
  """The user's data: Parquet files with a `text` column, as data sets on the hub ship them."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  os.makedirs(folder)
  for i in range(shards):
    table = pa.table({"id": list(range(i, len(documents), shards)), "text": documents[i::shards]})
    pq.write_table(table, os.path.join(folder, f"train-{i:05d}.parquet"), row_group_size=100)


def llama_folder(path):
  """What a user downloads: config.json + safetensors + tokenizer.json + tokenizer_config.json (Llama 3 specials)."""
  documents = corpus_documents()[:300]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<|begin_of_text|>", "<|end_of_text|>"]
  trainer = trainers.BpeTrainer(
    vocab_size=VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
  )
  tok.train_from_iterator(documents, trainer)
  rope = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)
  config = transformers.LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
    rope_parameters=dict(rope, rope_theta=500000.0, original_max_position_embeddings=32),
    max_position_embeddings=131072,
    bos_token_id=0,
    eos_token_id=1,
  )
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(config).save_pretrained(path)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": specials[0], "eos_token": specials[1], "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def test_readme_commands_convert_train_decode_export(tmp_path):
  """The README's four commands as written, with its paths pointed at this test's files and, appended (later keys
  win), what a laptop needs: float32, 3 steps of 64 tokens."""
  hf, out = str(tmp_path / "Llama-3.2-1B"), str(tmp_path / "export")
  llama_folder(hf)
  parquet_shards(str(tmp_path / "fineweb"), corpus_documents())
  places = {
    "Llama-3.2-1B": hf,
    "ckpt/llama3.2-1b": str(tmp_path / "ckpt"),
    "data/fineweb/*.parquet": f"{tmp_path}/fineweb/*.parquet",
    "outputs/llama32-cpt/checkpoints/2000": str(tmp_path / "llama32-cpt" / "checkpoints" / "3"),
    "llama32-cpt-hf": out,
  }
  pattern = re.compile("|".join(re.escape(k) for k in sorted(places, key=len, reverse=True)))
  laptop = {
    "convert_hf.py": ["weight_dtype=float32"],
    "train.py": ["dtype=float32", "weight_dtype=float32", "steps=3", "max_target_length=64", "per_device_batch_size=2"]
    + [f"base_output_directory={tmp_path}", "eval_interval=-1"],
    "decode.py": ["max_target_length=64", "max_prefill_predict_length=16", "max_decode_steps=8", "jax_cache_dir="],
  }
  commands = readme_commands("### Continue pretraining Llama 3.2 1B")
  assert [c[1] for c in commands] == ["MaxLite/convert_hf.py", "MaxLite/train.py", "MaxLite/decode.py"] + [
    "MaxLite/convert_hf.py"
  ]
  printed = {}
  for python, script, *args in commands:
    assert python == "python"
    args = [pattern.sub(lambda m: places[m.group(0)], a) for a in args]
    extra = [] if "to_hf" in args else laptop[os.path.basename(script)]
    printed[script] = output_of([script, *args, *extra])
  prompt = "The capital of France is"
  ours = printed["MaxLite/decode.py"].split(f"[0] {prompt}", 1)[1].rstrip("\n")

  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tok = transformers.AutoTokenizer.from_pretrained(out)
  assert (model.config.bos_token_id, model.config.eos_token_id) == (0, 1)  # from the tokenizer, not Llama 2's 1, 2
  assert model.config.rope_parameters["rope_type"] == "llama3" and model.config.tie_word_embeddings
  assert model.config.max_position_embeddings == 131072  # as the original folder declares
  original = transformers.AutoModelForCausalLM.from_pretrained(hf)
  assert not torch.equal(model.model.embed_tokens.weight, original.model.embed_tokens.weight)  # training moved it
  ids = [0] + tok(prompt, add_special_tokens=False)["input_ids"]  # add_bos=true, as decode.py
  with torch.no_grad():
    generated = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=1)[0, len(ids) :]
  assert tok.decode([t for t in generated.tolist() if t != 1]) == ours
