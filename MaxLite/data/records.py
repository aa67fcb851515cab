"""Post-training records -> documents with loss masks, for the packer (packing.Masked, packing.Group).

Every record becomes a Group, so the packer never splits it across rows: a conversation is one segment that sees
all of itself, as it does in transformers (one longer than a row keeps its first max_target_length tokens).

  chat               {"messages": [{role, content}, ...]}: rendered by the chat template (chat.py); with
                     sft_train_on_completion_only the loss covers the assistant's replies, else every token
  prompt_completion  {"prompt": str, "completion": str}: with use_chat_template a user turn and the assistant's
                     reply; without, BOS + prompt + completion + EOS (per add_bos/add_eos), the completion and EOS
                     learned
  preference         {"chosen", "rejected"} and optionally "prompt": two documents packed whole as a DPO pair. Each
                     side is a string (the prompt's continuation) or, with use_chat_template, a list of messages
                     (TRL's conversational format; a string prompt is then a user turn). Only the last reply is
                     the response; the prompt is shared and never counts.

A response with no token left (an empty completion) is kept: it trains nothing, and a DPO pair without a response
token on both sides is left out of the loss (objectives/dpo.py).
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from MaxLite.cli.errors import InputError
from MaxLite.data.chat import ChatTemplate, encode_chat
from MaxLite.data.packing import Group, Masked
from MaxLite.data.tokenizer import Tokenizer


def _last_run(mask: np.ndarray) -> np.ndarray:
  """The mask with only its last run of ones kept (the final reply of a conversation)."""
  ones = np.flatnonzero(mask)
  if not len(ones):
    return mask
  breaks = np.flatnonzero(np.diff(ones) > 1)
  start = ones[breaks[-1] + 1] if len(breaks) else ones[0]
  out = np.zeros_like(mask)
  out[start : ones[-1] + 1] = 1
  return out


def _text(record: dict[str, Any], column: str) -> str:
  value = record[column]
  if not isinstance(value, str):
    raise InputError(f"data record field {column!r} must be a string here, got {type(value).__name__}")
  return value


class EncodeRecord(grain.transforms.Map):
  """A record of the columns `kind` reads (config.post_training.data_kind) -> a Masked document or a Group."""

  def __init__(
    self,
    kind: str,
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
    completion_only: bool,
    add_bos: bool,
    add_eos: bool,
  ):
    self._kind, self._tok, self._template, self._completion_only = kind, tokenizer, template, completion_only
    self._bos = [tokenizer.bos_id] if add_bos and tokenizer.bos_id >= 0 else []
    self._eos = [tokenizer.eos_id] if add_eos and tokenizer.eos_id >= 0 else []

  def _plain(self, prompt: str, response: str, learn_prompt: bool) -> Masked:
    head = self._bos + self._tok.encode(prompt)
    tail = self._tok.encode(response) + self._eos
    mask = np.concatenate([np.full(len(head), int(learn_prompt)), np.ones(len(tail))]).astype(np.int32)
    return Masked(np.asarray(head + tail, np.int32), mask)

  def _chat(self, messages: Any, completion_only: bool) -> Masked:
    return Masked(*encode_chat(self._template, self._tok, messages, completion_only))

  def _response(self, prompt: Any, response: Any) -> Masked:
    """One side of a preference pair: the prompt (never learned) and its response."""
    if self._template is None:
      if not isinstance(response, str) or not isinstance(prompt, str):
        raise InputError("preference records without use_chat_template hold strings in prompt, chosen and rejected")
      return self._plain(prompt, response, learn_prompt=False)
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) and prompt else list(prompt or [])
    reply = [{"role": "assistant", "content": response}] if isinstance(response, str) else list(response)
    tokens, mask = self._chat(turns + reply, completion_only=True)
    return Masked(tokens, _last_run(mask))

  def map(self, record: dict[str, Any]) -> Group:
    if self._kind == "chat":
      return Group((self._chat(record["messages"], self._completion_only),))
    if self._kind == "prompt_completion":
      prompt, completion = _text(record, "prompt"), _text(record, "completion")
      if self._template is None:
        return Group((self._plain(prompt, completion, learn_prompt=not self._completion_only),))
      turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
      return Group((self._chat(turns, self._completion_only),))
    prompt = record.get("prompt", "")
    return Group((self._response(prompt, record["chosen"]), self._response(prompt, record["rejected"])))
