"""Chat templates: rendered ids equal transformers' apply_chat_template for a ChatML (Qwen) and a Llama-3-style
template on a tokenizer trained here, and for the shipped ChatML and Qwen3's own template on the shipped chat
tokenizer; the trained-token mask equals transformers' assistant mask ({% generation %} blocks), and an unmarked
template's mask equals its marked twin's, also where a reply repeats the user's words; templates see the special
tokens transformers gives them; jinja2 loads only with a template; bad templates and conversations are one-line
errors."""

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from support.config import REPO, read_records
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
# so rendered prefixes are not stable; its {% generation %} blocks say where the replies are.
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
  with pytest.raises(InputError, match="reply 2 cannot be located in the rendered conversation .* generation"):
    encode_chat(ChatTemplate.load(path, str(rewriting)), tokenizer, CONVERSATIONS[1])
  sandboxed = tmp_path / "escape.jinja"
  sandboxed.write_text("{{ messages.__class__.__mro__ }}")
  with pytest.raises(InputError, match="rendering a conversation failed"):
    encode_chat(ChatTemplate.load(path, str(sandboxed)), tokenizer, CONVERSATIONS[0])
  template = ChatTemplate.load(path)
  for bad in ([], "hello", [{"content": "no role"}]):
    with pytest.raises(InputError, match="conversation|chat message"):
      encode_chat(template, tokenizer, bad)


# Qwen3's own chat template (Qwen/Qwen3-0.6B's tokenizer_config.json): it locates the last user query and gives the
# replies after it a reasoning block (the last one always, an empty one if it has none), while earlier replies lose
# theirs; a reply's rendering therefore changes once a later turn exists.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""  # noqa: E501


def _replace_once(text: str, old: str, new: str) -> str:
  assert text.count(old) == 1, old
  return text.replace(old, new)


def _generation_marked_qwen3() -> str:
  """QWEN3 with each reply (after its `<|im_start|>assistant` header, through its `<|im_end|>` line) marked with
  {% generation %}, as a template written for transformers' assistant mask would mark it; it renders the same text."""
  text = QWEN3.replace(r"{{- '<|im_start|>' + message.role + '\n' + content }}", "{{- content }}")
  text = _replace_once(
    text,
    r"{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content",
    r"{{- '<think>\n' + reasoning_content",
  )
  text = _replace_once(
    text,
    "        {%- if loop.index0 > ns.last_query_index %}\n",
    "        {{- '<|im_start|>' + message.role + '\\n' }}{%- generation %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n",
  )
  return _replace_once(
    text,
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
    "        {{- '<|im_end|>\\n' }}{%- endgeneration %}\n    {%- elif message.role == \"tool\" %}",
  )


# The shipped ChatML template (assets/chat/chatml.jinja) with each reply marked for transformers' assistant mask.
CHATML_SHIPPED_MARKED = (
  "{%- for message in messages %}\n"
  "{%- if loop.first and message['role'] != 'system' %}\n"
  "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
  "{%- endif %}\n"
  "{%- if message['role'] == 'assistant' %}\n"
  "{{- '<|im_start|>assistant\\n' }}{%- generation %}{{- message['content'] + '<|im_end|>\\n' }}{%- endgeneration %}\n"
  "{%- else %}\n"
  "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
  "{%- endif %}\n"
  "{%- endfor %}\n"
  "{%- if add_generation_prompt %}\n"
  "{{- '<|im_start|>assistant\\n' }}\n"
  "{%- endif %}\n"
)
# Mistral v3's template (tools left out): the system message goes into the last message when that is a user turn,
# so once a reply follows, the turns before it render differently from the prompt its header ended.
MISTRAL = """\
{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
        {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant") }}
    {%- endif %}
    {%- set ns.index = ns.index + 1 %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST]" + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST]" + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] + eos_token }}
    {%- endif %}
{%- endfor %}
"""
CHAT_TOKENIZER = os.path.join(REPO, "assets", "tokenizer", "chat")
ECHO = "Repeat after me: hello world"
REPEATED = [
  {"role": "user", "content": ECHO},
  {"role": "assistant", "content": "hello world"},
  {"role": "user", "content": ECHO},
  {"role": "assistant", "content": "hello world"},
]


def _template_file(tmp_path, name: str) -> str:
  """The template of `name` (the shipped ChatML, Qwen3's or Mistral's) as a file for chat_template_path."""
  if name == "chatml":
    return os.path.join(REPO, "assets", "chat", "chatml.jinja")
  return _write(tmp_path / f"{name}.jinja", {"qwen3": QWEN3, "mistral": MISTRAL}[name])


def _generation_marked(name: str) -> str:
  """The template of `name` with each reply marked for transformers' assistant mask."""
  if name == "chatml":
    return CHATML_SHIPPED_MARKED
  if name == "qwen3":
    return _generation_marked_qwen3()
  reply = '{{- message["content"] + eos_token }}'
  return _replace_once(MISTRAL, reply, "{%- generation %}" + reply + "{%- endgeneration %}")


def _reference_mask(reference, text: str, trained: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
  """transformers' ids of `text` and 1 on the tokens holding a character of a trained [start, end) span, located
  with transformers' char_to_token as its assistant mask locates them."""
  out = reference(text, add_special_tokens=False)
  mask = [0] * len(out["input_ids"])
  for start, end in trained:
    for token in range(out.char_to_token(start), out.char_to_token(end - 1) + 1):
      mask[token] = 1
  return out["input_ids"], mask


@pytest.mark.parametrize("name", ["chatml", "qwen3"])
def test_a_reply_that_repeats_the_user_is_trained_in_its_own_turn(name, tmp_path):
  """The user asks twice for "hello world" to be repeated: each reply's tokens are the ones after its own
  `<|im_start|>assistant` header (Qwen3: the last one with its empty reasoning block), never the user's words."""
  user = f"<|im_start|>user\n{ECHO}<|im_end|>\n<|im_start|>assistant\n"
  last_reply = "hello world<|im_end|>\n" if name == "chatml" else "<think>\n\n</think>\n\nhello world<|im_end|>\n"
  system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" if name == "chatml" else ""
  pieces = [(system + user, 0), ("hello world<|im_end|>\n", 1), (user, 0), (last_reply, 1)]
  text = "".join(p for p, _ in pieces)
  spans, at = [], 0
  for piece, trained in pieces:
    if trained:
      spans.append((at, at + len(piece)))
    at += len(piece)
  reference = transformers.AutoTokenizer.from_pretrained(CHAT_TOKENIZER)
  expected_ids, expected_mask = _reference_mask(reference, text, spans)
  template = ChatTemplate.load(CHAT_TOKENIZER, _template_file(tmp_path, name))
  assert template.render(REPEATED) == text
  ids, mask = encode_chat(template, load_tokenizer(CHAT_TOKENIZER, "huggingface"), REPEATED)
  np.testing.assert_array_equal(ids, expected_ids)
  np.testing.assert_array_equal(mask, expected_mask)


TURNS = [
  REPEATED,
  [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": "<think>\nThe user wants a definition.\n</think>\n\nA mutable sequence."},
    {"role": "user", "content": "And a tuple? Answer: A mutable sequence."},
    {"role": "assistant", "content": "An immutable sequence.", "reasoning_content": "Contrast it with a list."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "A mutable sequence."},
  ],
]
QWEN3_TOOLS = [
  {"role": "user", "content": "Weather in Paris?"},
  {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}],
  },
  {"role": "tool", "content": "sunny"},
  {"role": "assistant", "content": "sunny", "thinking": "The tool said sunny.", "tool_calls": None},
]


@pytest.mark.parametrize(
  ("name", "messages"),
  [(name, m) for name in ("chatml", "qwen3", "mistral") for m in TURNS] + [("qwen3", QWEN3_TOOLS)],
  ids=["chatml-echo", "chatml-turns", "qwen3-echo", "qwen3-turns", "mistral-echo", "mistral-turns", "qwen3-tools"],
)
def test_untagged_template_masks_what_its_generation_marked_twin_does(name, messages, tmp_path):
  """An unmarked template's mask (found by rendering turn by turn) equals transformers' assistant mask for the
  same template with {% generation %} around each reply. Qwen3 rewrites earlier replies (reasoning dropped, the
  last one's added) and renders tool calls and results; Mistral moves the system message into the last user turn;
  transformers passes a message's `thinking` as its `reasoning_content` and leaves out keys that are None."""
  marked = _generation_marked(name)
  with open(_template_file(tmp_path, name)) as f:
    plain = f.read()
  reference = transformers.AutoTokenizer.from_pretrained(CHAT_TOKENIZER)
  assert reference.apply_chat_template(messages, chat_template=marked, tokenize=False) == (
    reference.apply_chat_template(messages, chat_template=plain, tokenize=False)
  )
  expected = reference.apply_chat_template(
    messages, chat_template=marked, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
  )
  assert sum(expected["assistant_masks"]) > 0
  tokenizer = load_tokenizer(CHAT_TOKENIZER, "huggingface")
  for source in (_template_file(tmp_path, name), _write(tmp_path / "marked.jinja", marked)):
    ids, mask = encode_chat(ChatTemplate.load(CHAT_TOKENIZER, source), tokenizer, messages)
    np.testing.assert_array_equal(ids, expected["input_ids"])
    np.testing.assert_array_equal(mask, expected["assistant_masks"], err_msg=source)


def _write(path, text: str) -> str:
  path.write_text(text)
  return str(path)


SPECIALS_SHOWN = (
  "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ sep_token }}|{{ pad_token }}|{{ cls_token }}|{{ mask_token }}"
  "|{{ image_token }}|{{ boi_token }}|{{ additional_special_tokens }}|{{ extra_special_tokens }}"
  "{% for m in messages %}|{{ m['content'] }}{% endfor %}"
)


@pytest.mark.parametrize("layout", ["saved", "legacy_map", "added_token_dicts"])
def test_templates_see_the_special_tokens_transformers_passes(layout, tmp_path):
  """Every named special token (bos, eos, unk, sep, pad, cls, mask) and the model's own named ones (image_token ...)
  reach the template as transformers' apply_chat_template passes them, whether tokenizer_config.json holds them as
  strings or AddedToken dicts, or an older special_tokens_map.json does; a list of extra tokens is not passed."""
  tok = Tokenizer.from_file(os.path.join(CHAT_TOKENIZER, "tokenizer.json"))
  named = dict(
    bos_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<|endoftext|>", sep_token="<|im_start|>",
    pad_token="<|endoftext|>", cls_token="<|im_start|>", mask_token="<|im_end|>",
  )  # fmt: skip
  hf = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, extra_special_tokens={"image_token": "<|im_start|>"}, **named
  )
  hf.chat_template = SPECIALS_SHOWN
  hf.save_pretrained(str(tmp_path))
  config_file = tmp_path / "tokenizer_config.json"
  config = json.loads(config_file.read_text())
  if layout == "legacy_map":  # an older repo: the tokens in special_tokens_map.json, none in the config
    (tmp_path / "special_tokens_map.json").write_text(
      json.dumps({k: {"content": v, "lstrip": False, "rstrip": False, "normalized": False} for k, v in named.items()})
    )
    config = {k: v for k, v in config.items() if k not in named}
  elif layout == "added_token_dicts":
    config.update({k: {"__type": "AddedToken", "content": v, "special": True} for k, v in named.items()})
    config.pop("image_token", None)
    config["extra_special_tokens"] = {"image_token": "<|im_start|>"}
    config["boi_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
  config_file.write_text(json.dumps(config))
  messages = CONVERSATIONS[0]
  expected = transformers.AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(messages, tokenize=False)
  assert "|<|im_start|>|<|endoftext|>|<|im_start|>|<|im_end|>|<|im_start|>|" in expected  # sep ... image_token
  assert ChatTemplate.load(str(tmp_path)).render(messages) == expected


@pytest.mark.slow
def test_jinja2_is_loaded_only_when_a_chat_template_is_used():
  """A pretraining run imports the data pipeline, which can render chats; jinja2 is imported on the first template
  compiled, so a run without one never needs it."""
  code = (
    "import sys\n"
    "import MaxLite.training.trainer\n"
    "from MaxLite.data.chat import ChatTemplate\n"
    "assert 'jinja2' not in sys.modules, 'jinja2 was imported by the training modules'\n"
    f"ChatTemplate.load({CHAT_TOKENIZER!r}).render([{{'role': 'user', 'content': 'hi'}}])\n"
    "assert 'jinja2' in sys.modules\n"
  )
  done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
