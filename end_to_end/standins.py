"""Small stand-ins for what the README's commands download or the user brings: Hugging Face model folders (config.json,
safetensors, tokenizer files) of tiny random Llama 2, Llama 3 and Qwen3 models, text files and Parquet shards made from
the shipped corpus. Each is what the real thing is in every way a command reads, only smaller; nothing is fetched."""

from __future__ import annotations

import json
import os
import shutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3_VOCAB = 512


def corpus_documents(shard: int = 0) -> list[str]:
  from array_record.python.array_record_module import ArrayRecordReader

  path = os.path.join(REPO, "assets", "corpus", f"train-{shard:05d}-of-00004.array_record")
  reader = ArrayRecordReader(path)
  try:
    return [r.decode("utf-8") for r in reader.read(list(range(reader.num_records())))]
  finally:
    reader.close()


def text_files(folder: str, documents: list[str], files: int = 4) -> None:
  """The user's own text: .txt files whose documents are separated by blank lines."""
  os.makedirs(folder, exist_ok=True)
  for i in range(files):
    with open(os.path.join(folder, f"part-{i}.txt"), "w") as f:
      f.write("\n\n".join(doc.replace("\n\n", "\n") for doc in documents[i::files]) + "\n")


def parquet_shards(folder: str, documents: list[str], shards: int = 2) -> None:
  """The user's data: Parquet files with a `text` column, as data sets on the hub ship them."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  os.makedirs(folder, exist_ok=True)
  for i in range(shards):
    table = pa.table({"id": list(range(i, len(documents), shards)), "text": documents[i::shards]})
    pq.write_table(table, os.path.join(folder, f"train-{i:05d}.parquet"), row_group_size=100)


def _save(model_class, config, path: str) -> None:
  import torch

  torch.manual_seed(0)
  model_class(config).save_pretrained(path)


def llama2_folder(path: str) -> None:
  """A Llama 2 download in small: config.json + safetensors + a sentencepiece tokenizer.model (the shipped one,
  BOS 1 / EOS 2, as Llama 2's)."""
  import transformers

  config = transformers.LlamaConfig(
    vocab_size=8192,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
  )
  _save(transformers.LlamaForCausalLM, config, path)
  shutil.copy(os.path.join(REPO, "assets", "tokenizer", "maxlite_sp8k.model"), os.path.join(path, "tokenizer.model"))


def llama3_folder(path: str) -> None:
  """A Llama 3.2 download in small: config.json (llama3 RoPE scaling, tied embeddings, GQA) + safetensors +
  tokenizer.json + tokenizer_config.json with Llama 3's special tokens (here BOS 0 / EOS 1)."""
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<|begin_of_text|>", "<|end_of_text|>"]
  trainer = trainers.BpeTrainer(
    vocab_size=LLAMA3_VOCAB,
    special_tokens=specials,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(corpus_documents()[:300], trainer)
  rope = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)
  config = transformers.LlamaConfig(
    vocab_size=LLAMA3_VOCAB,
    # Two query heads sharing one key/value head (GQA) of width 16: the README trains this stand-in on 4 x 4096
    # tokens, where the attention scores are most of a step's work on a CPU.
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    tie_word_embeddings=True,
    rope_parameters=dict(rope, rope_theta=500000.0, original_max_position_embeddings=32),
    max_position_embeddings=131072,
    bos_token_id=0,
    eos_token_id=1,
  )
  _save(transformers.LlamaForCausalLM, config, path)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": specials[0], "eos_token": specials[1], "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def qwen3_folder(path: str):
  """A Qwen3 download in small: config.json + safetensors, and tokenizer files with a chat template (the shipped
  ChatML tokenizer: EOS <|im_end|>, no BOS, as Qwen's). Returns the transformers config."""
  import transformers

  tokenizer_dir = os.path.join(REPO, "assets", "tokenizer", "chat")
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
  _save(transformers.Qwen3ForCausalLM, config, path)
  for name in os.listdir(tokenizer_dir):
    shutil.copy(os.path.join(tokenizer_dir, name), path)
  return config
