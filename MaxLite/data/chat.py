"""Chat templates: a conversation (a list of {role, content} messages) -> token ids and which of them to train on.

The template is the tokenizer's own Jinja2 template, rendered the way transformers' `apply_chat_template` renders it
(a sandboxed environment with trim_blocks and lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII text, and
`raise_exception` / `strftime_now`; the tokenizer's special tokens as variables; messages without their None-valued
keys and with a reasoning under any of its names under all of them), so the ids equal transformers' ids for the same
tokenizer and messages. jinja2 is imported when the first template is compiled: runs without one never need it.
Where the template comes from, first found wins:

  chat_template_path       a .jinja file, or a JSON file with a "chat_template" string (as tokenizer_config.json)
  chat_template.jinja      beside the tokenizer (transformers 5 saves the template there)
  tokenizer_config.json    its "chat_template" (a string, or a list of {name, template} of which "default" is used)

Which tokens are the assistant's (trained with sft_train_on_completion_only) is read from the template's structure,
never by searching the text (a reply may repeat the user's words):

  - A template that marks replies with `{% generation %} ... {% endgeneration %}` trains on what those blocks render,
    exactly as transformers' return_assistant_tokens_mask.
  - Otherwise by rendering prefixes: reply i starts after the conversation before it rendered with
    add_generation_prompt=True (the assistant's header) and ends where the conversation through it ends, as long as
    both renderings begin the whole conversation's (Llama, Qwen2.5, Gemma, ChatML templates).
  - A template that renders the conversation differently once it goes on past a reply is read with marks: a mark
    appended to the reply's content shows where the content ends (the first character at which the rendering
    changes), and the reply goes on with what follows its content when it is the last message (its end-of-turn
    text), which must follow it here too. The reply starts after its header when the header still begins the whole
    rendering (Qwen3 drops an earlier reply's reasoning block and gives only the last reply an empty one); if not
    (Mistral moves the system message into the last user turn), a mark prepended to the content shows where the
    content starts, and the reply starts with what precedes its content when it is the last message.

The trained tokens are those holding a reply's first to last character (by the tokenizer's character offsets), as
in transformers' assistant mask.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from MaxLite import storage
from MaxLite.cli.errors import InputError, first_line
from MaxLite.data.hf_tokenizer import read_json_object

if TYPE_CHECKING:
  import jinja2

Message = dict[str, Any]
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens a template is given when the tokenizer has them.
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The names a message's reasoning goes by; transformers fills in "thinking" and "reasoning_content" from the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")  # transformers' test for a marked template
# Put at an end of a reply's content to see where the template puts that end: a private-use character, which no
# template tests for or strips.
_MARK = "\ue000"


@functools.cache
def _generation_extension() -> type:
  """The `{% generation %}` extension class (built on first use, so that importing this module needs no jinja2)."""
  import jinja2
  import jinja2.ext

  class Generation(jinja2.ext.Extension):
    """`{% generation %} ... {% endgeneration %}`, which marks the assistant's text for transformers: rendered as its
    body; while a render is tracked, the [start, end) characters of each block are recorded as transformers records
    them (the length of the output yielded so far)."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment):
      super().__init__(environment)
      # Per thread: a compiled template may be shared by threads rendering different conversations.
      environment.extend(generation_tracker=threading.local())

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    def _generation_support(self, caller: Any) -> str:
      text = caller()
      tracker = self.environment.generation_tracker
      if getattr(tracker, "blocks", None) is not None:
        start = sum(len(block) for block in tracker.blocks)
        tracker.spans.append((start, start + len(text)))
      return text

  return Generation


def _raise_exception(message: str) -> None:
  import jinja2

  raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
  return datetime.datetime.now().strftime(format)


def compile_template(source: str, where: str = "chat template") -> jinja2.Template:
  """A template that renders as transformers renders it; InputError naming `where` when it does not parse."""
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
  try:
    return env.from_string(source)
  except jinja2.TemplateError as e:
    raise InputError(f"{where}: not a valid Jinja2 template ({first_line(e)})") from None


def _read_json(path: str) -> dict[str, Any]:
  data = read_json_object(path)
  if data is None:
    raise InputError(f"file not found: {path!r}")
  return data


def _template_of(config: dict[str, Any], path: str) -> str | None:
  template = config.get("chat_template")
  if isinstance(template, list):  # several named templates: transformers uses "default"
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default")
  if template is not None and not isinstance(template, str):
    raise InputError(f"{path!r}: chat_template is not a string")
  return template


def _tokenizer_folder(tokenizer_path: str) -> str:
  return tokenizer_path if storage.isdir(tokenizer_path) else storage.dirname(tokenizer_path)


def load_template_source(tokenizer_path: str, chat_template_path: str = "") -> tuple[str, str]:
  """(template text, where it came from) by the order in the module docstring; InputError when there is none."""
  if chat_template_path:
    if not storage.isfile(chat_template_path):
      raise InputError(f"chat_template_path: file not found: {chat_template_path!r}")
    if chat_template_path.endswith(".json"):
      template = _template_of(_read_json(chat_template_path), chat_template_path)
      if template is None:
        raise InputError(f"chat_template_path: {chat_template_path!r} has no 'chat_template' string")
      return template, chat_template_path
    return storage.read_text(chat_template_path), chat_template_path
  folder = _tokenizer_folder(tokenizer_path)
  jinja_file = storage.join(folder, "chat_template.jinja")
  if storage.isfile(jinja_file):
    return storage.read_text(jinja_file), jinja_file
  config_file = storage.join(folder, "tokenizer_config.json")
  if storage.isfile(config_file) and (template := _template_of(_read_json(config_file), config_file)) is not None:
    return template, config_file
  raise InputError(
    f"use_chat_template=true but the tokenizer {tokenizer_path!r} has no chat template (no chat_template.jinja, no "
    "chat_template in tokenizer_config.json); set chat_template_path to a .jinja or tokenizer_config-style .json file"
  )


def _token_text(value: Any) -> str | None:
  """A token as written in a tokenizer's files: a string, or an AddedToken written out as a dict."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def special_tokens(tokenizer_path: str) -> dict[str, str]:
  """The special tokens a template is given, as transformers 5's apply_chat_template gives them (the tokenizer's
  special_tokens_map): the named ones (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token)
  that are set, and the model's own named tokens (another `*_token` key, or an `extra_special_tokens` mapping, such
  as Gemma's image_token), read from tokenizer_config.json beside the tokenizer. An older tokenizer whose config has
  no added_tokens_decoder may keep them in special_tokens_map.json, which transformers then lets override the
  config. A list of extra special tokens is not given (transformers 5 gives none), and neither are the defaults a
  tokenizer class fills in for a token its files leave out (Qwen2Tokenizer's unk_token and pad_token)."""
  folder = _tokenizer_folder(tokenizer_path)
  config_file = storage.join(folder, "tokenizer_config.json")
  config = _read_json(config_file) if storage.isfile(config_file) else {}
  own = {
    k: v for k, v in config.items() if k.endswith("_token") and k not in _NAMED_TOKENS and _token_text(v) is not None
  }
  extra = config.get("extra_special_tokens")
  if isinstance(extra, dict):
    own.update(extra)
  named = {k: config.get(k) for k in _NAMED_TOKENS}
  map_file = storage.join(folder, "special_tokens_map.json")
  if "added_tokens_decoder" not in config and storage.isfile(map_file):
    legacy = _read_json(map_file)
    named.update({k: legacy[k] for k in _NAMED_TOKENS if k in legacy})
    if isinstance(legacy.get("extra_special_tokens"), dict):
      own.update(legacy["extra_special_tokens"])
  out = {}
  for key, value in (named | own).items():
    if (text := _token_text(value)) is not None:
      out[key] = text
  return out


def _as_transformers_passes(messages: Sequence[Message]) -> list[Message]:
  """The messages as transformers hands them to a template: without None-valued keys (a template tests whether a
  key is there, and would render a None as "None"), and with a reasoning under any of its names also under
  "thinking" and "reasoning_content" (the names templates read)."""
  out = []
  for message in messages:
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    out.append(message)
  return out


class ChatTemplate:
  """A compiled template with the tokenizer's special tokens bound; picklable (it re-compiles from its source)."""

  def __init__(self, source: str, specials: dict[str, str], where: str = "chat template"):
    self.source, self.specials, self.where = source, dict(specials), where
    self.marks_generation = _GENERATION_TAG.search(source) is not None
    self._template = compile_template(source, where)

  @classmethod
  def load(cls, tokenizer_path: str, chat_template_path: str = "") -> ChatTemplate:
    source, where = load_template_source(tokenizer_path, chat_template_path)
    return cls(source, special_tokens(tokenizer_path), where)

  def __getstate__(self) -> dict[str, Any]:
    return {"source": self.source, "specials": self.specials, "where": self.where}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__init__(state["source"], state["specials"], state["where"])

  def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    return "".join(self._generate(messages, add_generation_prompt, None))

  def render_tracked(self, messages: Sequence[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) characters of each `{% generation %}` block in it."""
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    tracker = self._template.environment.generation_tracker
    tracker.blocks, tracker.spans = blocks, spans
    try:
      self._generate(messages, False, blocks)
    finally:
      tracker.blocks = tracker.spans = None
    return "".join(blocks), spans

  def _generate(self, messages: Sequence[Message], add_generation_prompt: bool, blocks: list[str] | None) -> list:
    import jinja2

    blocks = [] if blocks is None else blocks
    try:
      for block in self._template.generate(
        messages=_as_transformers_passes(messages),
        add_generation_prompt=add_generation_prompt,
        tools=None,
        documents=None,
        **self.specials,
      ):
        blocks.append(block)  # appended one by one: the {% generation %} extension measures them as they come
    except jinja2.TemplateError as e:
      raise InputError(f"{self.where}: rendering a conversation failed ({first_line(e)})") from None
    return blocks


def _tokens_covering(offsets: np.ndarray, first: int, last: int) -> slice:
  """The tokens from the one holding character `first` to the one holding character `last` (inclusive)."""
  start = np.searchsorted(offsets[:, 1], first, side="right")
  stop = np.searchsorted(offsets[:, 0], last, side="right")
  return slice(int(start), int(stop))


def check_messages(messages: Any) -> list[Message]:
  """The messages as a list of dicts with string role and content; InputError saying what is wrong otherwise."""
  if not isinstance(messages, (list, tuple)) or not messages:
    raise InputError(f"a conversation must be a non-empty list of {{role, content}} messages, got {messages!r:.80}")
  for message in messages:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
      raise InputError(f"a chat message must be a dict with a string 'role', got {message!r:.80}")
  return [dict(m) for m in messages]


def encode_chat(
  template: ChatTemplate, tokenizer: Any, messages: Sequence[Message], completion_only: bool = True
) -> tuple[np.ndarray, np.ndarray]:
  """(ids, mask): the rendered conversation's ids (transformers' apply_chat_template ids) and 1 where the loss is
  taken: the tokens holding the assistant's replies when completion_only, else every token. `tokenizer` is a
  HuggingFaceTokenizer (its character offsets place the replies)."""
  messages = check_messages(messages)
  if completion_only and template.marks_generation:
    whole, spans = template.render_tracked(messages)
  else:
    whole, spans = template.render(messages), None
  ids, offsets = tokenizer.encode_with_offsets(whole)
  ids, offsets = np.asarray(ids, np.int32), np.asarray(offsets, np.int64).reshape(-1, 2)
  mask = np.full(len(ids), 0 if completion_only else 1, np.int32)
  if not completion_only:
    return ids, mask
  if spans is None:
    spans = _reply_spans(template, messages, whole)
  for start, end in spans:
    if end > start:
      mask[_tokens_covering(offsets, start, end - 1)] = 1
  return ids, mask


def _unlocatable(template: ChatTemplate, index: int, why: str) -> InputError:
  return InputError(
    f"{template.where}: reply {index} cannot be located in the rendered conversation ({why}); mark the replies "
    "with {% generation %} in the template, or train on every token (sft_train_on_completion_only=false)"
  )


def _reply_spans(template: ChatTemplate, messages: list[Message], whole: str) -> list[tuple[int, int]]:
  """[start, end) characters of each reply in `whole`, found by rendering prefixes (module docstring)."""
  spans = []
  for i, message in enumerate(messages):
    if message["role"] != "assistant":
      continue
    header = template.render(messages[:i], add_generation_prompt=True)
    through_reply = template.render(messages[: i + 1])
    if whole.startswith(through_reply) and through_reply.startswith(header):
      spans.append((len(header), len(through_reply)))
    else:
      spans.append(_rewritten_reply(template, messages, i, whole, header, through_reply))
  return spans


def _rewritten_reply(
  template: ChatTemplate, messages: list[Message], index: int, whole: str, header: str, through_reply: str
) -> tuple[int, int]:
  """[start, end) of reply `index` in `whole` when the conversation renders differently once it goes on past the
  reply (module docstring). The reply rendered as the last message (`through_reply`) shows what the template puts
  around its content; marks on the content show where the content is in each rendering."""
  last = messages[: index + 1]
  last_end = _content_edge(template, last, index, through_reply, at_end=True)
  content_end = _content_edge(template, messages, index, whole, at_end=True)
  if last_end is None or content_end is None:
    raise _unlocatable(template, index, "the template does not render its content")
  ending = through_reply[last_end:]
  if not whole.startswith(ending, content_end):
    raise _unlocatable(template, index, f"its content is not followed by {ending[:40]!r} as in the last turn")
  if whole.startswith(header):  # the turns before it render as they do without it: the reply starts after them
    start = len(header)
  else:  # a template that moves text into the last user turn (Mistral's system message): from the content on
    content_start = _content_edge(template, messages, index, whole, at_end=False)
    if content_start is None:
      raise _unlocatable(template, index, "the template does not render its content")
    opening = ""  # what the template puts between the assistant's header and the content, when it shows
    last_start = _content_edge(template, last, index, through_reply, at_end=False)
    if through_reply.startswith(header) and last_start is not None and last_start >= len(header):
      opening = through_reply[len(header) : last_start]
    start = content_start - len(opening)
    if start < 0 or whole[start:content_start] != opening:
      raise _unlocatable(template, index, f"its content is not preceded by {opening[:40]!r} as in the last turn")
  if content_end < start:
    raise _unlocatable(template, index, "the template renders its content before its turn")
  return start, content_end + len(ending)


def _content_edge(
  template: ChatTemplate, messages: list[Message], index: int, rendered: str, at_end: bool
) -> int | None:
  """Where the content of message `index` ends (at_end) or starts in `rendered`, the messages' rendering: where the
  rendering first changes once a mark is appended (prepended) to the content; None when it does not change or the
  content is not text."""
  content = messages[index].get("content")
  if not isinstance(content, (str, type(None))):
    return None
  content = content or ""
  marked = list(messages)
  marked[index] = dict(messages[index], content=content + _MARK if at_end else _MARK + content)
  again = template.render(marked)
  return None if again == rendered else len(os.path.commonprefix([rendered, again]))
