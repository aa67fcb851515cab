"""A small Hugging Face chat tokenizer trained on the shipped corpus, laid out as Qwen's is: a byte-level BPE
tokenizer.json, a tokenizer_config.json naming <|im_end|> as EOS and no BOS, and a ChatML chat_template.jinja
(assets/chat/chatml.jinja). It lets the tiny test models fine-tune on chats with use_chat_template exactly as
Qwen3 does, with nothing downloaded; make_post_training_data.py writes it to assets/tokenizer/chat/.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from MaxLite import storage
from MaxLite.data.sources import open_source

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEMPLATE = os.path.join(storage.bundled_root(), "assets", "chat", "chatml.jinja")


def train_chat_tokenizer(files: str, output_dir: str, vocab_size: int = 4096) -> str:
  """Trains on the documents of `files` (ArrayRecord) and writes the three files; returns output_dir."""
  source = open_source(storage.resolve_list(files))
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(SPECIALS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tokenizer.train_from_iterator((source[i].decode("utf-8") for i in range(len(source))), trainer)
  os.makedirs(output_dir, exist_ok=True)
  tokenizer.save(os.path.join(output_dir, "tokenizer.json"))
  config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 32768}
  with open(os.path.join(output_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  with open(TEMPLATE, encoding="utf-8") as src, open(os.path.join(output_dir, "chat_template.jinja"), "w") as dst:
    dst.write(src.read())
  return output_dir
