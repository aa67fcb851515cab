"""Chat templates: a conversation (a list of {role, content} messages) -> token ids and which of them to train on.

The template is the tokenizer's own Jinja2 template, rendered the way transformers' `apply_chat_template` renders it
(a sandboxed environment with trim_blocks and lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII text, and
`raise_exception` / `strftime_now`), so the ids equal transformers' ids for the same tokenizer and messages. Where it
comes from, first found wins:

  chat_template_path       a .jinja file, or a JSON file with a "chat_template" string (as tokenizer_config.json)
  chat_template.jinja      beside the tokenizer (transformers 5 saves the template there)
  tokenizer_config.json    its "chat_template" (a string, or a list of {name, template} of which "default" is used)

Which tokens are the assistant's (trained with sft_train_on_completion_only) is found by rendering, not by parsing:
the reply to message i is what the conversation up to and including it renders to beyond the conversation before it
rendered with add_generation_prompt=True (the assistant's header). That needs both renderings to be prefixes of the
whole conversation's rendering, as they are for the templates of Llama, Qwen2.5, Mistral and Gemma. For a template that
rewrites earlier turns (Qwen3 drops an earlier reply's reasoning block), each reply's content is found in order in the
rendered text instead, through the end-of-turn (EOS) token after it. The trained tokens are those holding the reply's
first to last character (by the tokenizer's character offsets), as in transformers' assistant mask.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from MaxLite import storage
from MaxLite.cli.errors import InputError, first_line
from MaxLite.data.hf_tokenizer import read_json_object

Message = dict[str, Any]
_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class _Generation(jinja2.ext.Extension):
  """`{% generation %} ... {% endgeneration %}` (templates that mark the assistant's text for transformers): rendered
  as its body; the trained tokens are found by rendering prefixes instead (module docstring)."""

  tags = {"generation"}

  def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
  raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
  return datetime.datetime.now().strftime(format)


def compile_template(source: str, where: str = "chat template") -> jinja2.Template:
  """A template that renders as transformers renders it; InputError naming `where` when it does not parse."""
  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
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


def special_tokens(tokenizer_path: str) -> dict[str, str]:
  """bos_token, eos_token, ... as strings, from tokenizer_config.json beside the tokenizer (templates use them)."""
  config_file = storage.join(_tokenizer_folder(tokenizer_path), "tokenizer_config.json")
  config = _read_json(config_file) if storage.isfile(config_file) else {}
  out = {}
  for key in _SPECIAL_KEYS:
    token = config.get(key)
    if isinstance(token, dict):  # an AddedToken written out
      token = token.get("content")
    if isinstance(token, str):
      out[key] = token
  return out


class ChatTemplate:
  """A compiled template with the tokenizer's special tokens bound; picklable (it re-compiles from its source)."""

  def __init__(self, source: str, specials: dict[str, str], where: str = "chat template"):
    self.source, self.specials, self.where = source, dict(specials), where
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
    try:
      return self._template.render(
        messages=list(messages),
        add_generation_prompt=add_generation_prompt,
        tools=None,
        documents=None,
        **self.specials,
      )
    except jinja2.TemplateError as e:
      raise InputError(f"{self.where}: rendering a conversation failed ({first_line(e)})") from None


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
  whole = template.render(messages)
  ids, offsets = tokenizer.encode_with_offsets(whole)
  ids, offsets = np.asarray(ids, np.int32), np.asarray(offsets, np.int64).reshape(-1, 2)
  mask = np.full(len(ids), 0 if completion_only else 1, np.int32)
  if not completion_only:
    return ids, mask
  spans = _reply_spans(template, messages, whole)
  if spans is None:
    spans = _reply_spans_by_content(template, messages, whole)
  for first, last in spans:
    mask[_tokens_covering(offsets, first, last)] = 1
  return ids, mask


def _reply_spans(template: ChatTemplate, messages: list[Message], whole: str) -> list[tuple[int, int]] | None:
  """[first, last] characters of each reply, found by rendering prefixes; None if the template is not prefix-stable."""
  spans = []
  for i, message in enumerate(messages):
    if message["role"] != "assistant":
      continue
    header = template.render(messages[:i], add_generation_prompt=True)
    through_reply = template.render(messages[: i + 1])
    if not (whole.startswith(through_reply) and through_reply.startswith(header)):
      return None
    if len(through_reply) > len(header):
      spans.append((len(header), len(through_reply) - 1))
  return spans


def _reply_spans_by_content(template: ChatTemplate, messages: list[Message], whole: str) -> list[tuple[int, int]]:
  """For templates that render a turn differently once later turns follow (Qwen3 drops an earlier reply's reasoning
  block): each reply's content, found in order in the rendered text, through the end-of-turn token after it."""
  end_of_turn = template.specials.get("eos_token", "")
  spans, cursor = [], 0
  for i, message in enumerate(messages):
    content = message.get("content")
    if message["role"] != "assistant" or not isinstance(content, str) or not content.strip():
      continue
    start = whole.find(content.strip(), cursor)
    if start < 0:
      raise InputError(
        f"{template.where}: reply {i} is not in the rendered conversation, so it cannot be located; train on every "
        "token (sft_train_on_completion_only=false)"
      )
    stop = start + len(content.strip())
    if end_of_turn and (found := whole.find(end_of_turn, stop)) >= 0:
      stop = found + len(end_of_turn)
    spans.append((start, stop - 1))
    cursor = stop
  return spans
