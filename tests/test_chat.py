"""Chat templates: rendered ids equal transformers' apply_chat_template for a ChatML (Qwen) and a Llama-3-style
template on a tokenizer trained here; the trained-token mask equals transformers' assistant mask; bad templates and
conversations are one-line errors."""

import json
import os
import pickle

import numpy as np
import pytest
from conftest import REPO, read_records
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from MaxLite.cli.errors import InputError
from MaxLite.data.chat import ChatTemplate, encode_chat
from MaxLite.data.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = os.path.join(REPO, "assets", "corpus", "train-00000-of-00004.array_record")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip

# Qwen's ChatML, with the assistant's text marked for transformers' return_assistant_tokens_mask.
CHATML = (
  "{% for message in messages %}"
  "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
  "<|im_start|>{{ message['role'] }}\n"
  "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>\n{% endgeneration %}"
  "{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}"
  "{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3's shape: BOS from the tokenizer config, headers, content trimmed, <|eot_id|> after each turn.
LLAMA3 = (
  "{{ bos_token }}"
  "{% for message in messages %}"
  "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
  "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}<|eot_id|>{% endgeneration %}"
  "{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}"
  "{% endfor %}"
  "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

CONVERSATIONS = [
  [{"role": "user", "content": "What does range() return?"}, {"role": "assistant", "content": "A range object."}],
  [
    {"role": "system", "content": "Answer from the Python docs."},
    {"role": "user", "content": "How do I open a file?  "},
    {"role": "assistant", "content": "  Use open(path, 'r') — naïve café 🙂"},
    {"role": "user", "content": "And close it?"},
    {"role": "assistant", "content": "Call f.close(), or use a with block."},
  ],
  [{"role": "user", "content": "Only a question, {{ not a template }} <|im_end|>"}],
]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
  """A byte-level BPE trained on shipped text, saved by transformers with each template (ChatML without a BOS, as
  Qwen; Llama 3 with one)."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=700, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
  )
  tok.train_from_iterator(read_records([CORPUS])[:200], trainer)
  dirs = {}
  for name, template, bos, eos in (
    ("chatml", CHATML, None, "<|im_end|>"),
    ("llama3", LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
  ):
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    hf.chat_template = template
    path = str(tmp_path_factory.mktemp(name))
    hf.save_pretrained(path)
    dirs[name] = path
  return dirs


@pytest.mark.parametrize("name", ["chatml", "llama3"])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_ids_and_mask_equal_transformers(tokenizer_dirs, name, index):
  path = tokenizer_dirs[name]
  messages = CONVERSATIONS[index]
  reference = transformers.AutoTokenizer.from_pretrained(path)
  expected = reference.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
  template = ChatTemplate.load(path)
  ids, mask = encode_chat(template, load_tokenizer(path, "huggingface"), messages)
  np.testing.assert_array_equal(ids, expected["input_ids"])
  np.testing.assert_array_equal(mask, expected["assistant_masks"])
  assert mask.any() == any(m["role"] == "assistant" for m in messages)
  _, every = encode_chat(template, load_tokenizer(path, "huggingface"), messages, completion_only=False)
  assert every.all()
  # Grain workers get the template by pickle.
  again = pickle.loads(pickle.dumps(template))
  assert again.render(messages) == template.render(messages)


# Qwen3's shape: the last reply gets an (empty) reasoning block that earlier replies lose once a later turn exists,
# so rendered prefixes are not stable and replies are located by their content.
QWEN3_LIKE = (
  "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
  "{% if message['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
  "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
  "{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_that_rewrites_earlier_turns_masks_reply_contents(tokenizer_dirs, tmp_path):
  path = tokenizer_dirs["chatml"]
  template_file = tmp_path / "qwen3.jinja"
  template_file.write_text(QWEN3_LIKE)
  reference = transformers.AutoTokenizer.from_pretrained(path)
  messages = [
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": "A mutable sequence."},
    {"role": "user", "content": "And a tuple?"},
    {"role": "assistant", "content": "An immutable one."},
  ]
  expected = reference.apply_chat_template(
    messages, chat_template=QWEN3_LIKE, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
  )
  ids, mask = encode_chat(ChatTemplate.load(path, str(template_file)), load_tokenizer(path, "huggingface"), messages)
  np.testing.assert_array_equal(ids, expected["input_ids"])
  np.testing.assert_array_equal(mask, expected["assistant_masks"])


def test_template_sources(tokenizer_dirs, tmp_path):
  path = tokenizer_dirs["chatml"]
  messages = CONVERSATIONS[0]
  # transformers 5 saves the template beside the tokenizer; tokenizer_config.json's chat_template is the fallback.
  jinja = os.path.join(path, "chat_template.jinja")
  assert os.path.exists(jinja)
  plain = ChatTemplate.load(path)
  os.rename(jinja, jinja + ".moved")
  try:
    with pytest.raises(InputError, match="has no chat template"):
      ChatTemplate.load(path)
  finally:
    os.rename(jinja + ".moved", jinja)
  as_file = tmp_path / "llama.jinja"
  as_file.write_text(LLAMA3)
  as_json = tmp_path / "tokenizer_config.json"
  as_json.write_text(json.dumps({"chat_template": [{"name": "default", "template": LLAMA3}]}))
  from_file = ChatTemplate.load(path, str(as_file))
  assert from_file.render(messages) != plain.render(messages)
  assert ChatTemplate.load(path, str(as_json)).render(messages) == from_file.render(messages)


def test_bad_templates_and_conversations(tokenizer_dirs, tmp_path):
  path = tokenizer_dirs["chatml"]
  tokenizer = load_tokenizer(path, "huggingface")
  with pytest.raises(InputError, match="chat_template_path: file not found"):
    ChatTemplate.load(path, str(tmp_path / "missing.jinja"))
  broken = tmp_path / "broken.jinja"
  broken.write_text("{% for m in messages %}")
  with pytest.raises(InputError, match="not a valid Jinja2 template"):
    ChatTemplate.load(path, str(broken))
  refusing = tmp_path / "refusing.jinja"
  refusing.write_text("{{ raise_exception('only user turns') }}")
  with pytest.raises(InputError, match="only user turns"):
    encode_chat(ChatTemplate.load(path, str(refusing)), tokenizer, CONVERSATIONS[0])
  # A template that drops earlier replies once a later turn exists: they cannot be located.
  rewriting = tmp_path / "rewriting.jinja"
  rewriting.write_text(
    "{% for m in messages %}{{ m['content'] if loop.last or m['role'] != 'assistant' else 'x' }}\n{% endfor %}"
  )
  with pytest.raises(InputError, match="reply 2 is not in the rendered conversation"):
    encode_chat(ChatTemplate.load(path, str(rewriting)), tokenizer, CONVERSATIONS[1])
  sandboxed = tmp_path / "escape.jinja"
  sandboxed.write_text("{{ messages.__class__.__mro__ }}")
  with pytest.raises(InputError, match="rendering a conversation failed"):
    encode_chat(ChatTemplate.load(path, str(sandboxed)), tokenizer, CONVERSATIONS[0])
  template = ChatTemplate.load(path)
  for bad in ([], "hello", [{"content": "no role"}]):
    with pytest.raises(InputError, match="conversation|chat message"):
      encode_chat(template, tokenizer, bad)
