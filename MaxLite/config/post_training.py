"""What the post-training objectives share about their data: which record a set of columns is, and the checks of
record columns, files and chat templates. Pure functions of the raw dict; each objective (MaxLite/objectives/) calls
them from its own `derive`.

`data_kind(columns)` tells the input pipeline what a record is: "text" (pretraining documents), "chat" (a `messages`
list), "prompt_completion" or "preference" (chosen/rejected, optionally with a shared prompt). GRPO reads "prompts":
records whose first column is the prompt and whose other columns go to the reward functions.
"""

from __future__ import annotations

from typing import Any

from MaxLite.cli.errors import ConfigError


def columns(c: dict[str, Any], key: str, allowed: tuple[tuple[str, ...], ...], what: str) -> tuple[str, ...]:
  """c[key] (or its first allowed value when empty), one ConfigError line when it is none of `allowed`."""
  found = tuple(c[key]) or allowed[0]
  if found not in allowed:
    shown = " or ".join(str(list(a)) for a in allowed)
    raise ConfigError(f"{key}={list(c[key])} does not fit {what}; use {shown}")
  return found


def data_kind(columns: tuple[str, ...] | list[str]) -> str:
  """What a record of these columns is (module docstring)."""
  columns = tuple(columns)
  if len(columns) == 1 and columns != ("messages",):
    return "text"
  if columns == ("messages",):
    return "chat"
  if columns == ("prompt", "completion"):
    return "prompt_completion"
  return "preference"


def check_chat_template(c: dict[str, Any]) -> None:
  if c["use_chat_template"] and c["tokenizer_type"] != "huggingface":
    raise ConfigError(
      f"use_chat_template=true needs tokenizer_type=huggingface (a tokenizer.json directory with its chat template), "
      f"got {c['tokenizer_type']!r}"
    )


def derive_records(c: dict[str, Any], allowed: tuple[tuple[str, ...], ...], flag: str) -> dict[str, Any]:
  """train_data_columns / eval_data_columns of an objective reading records (SFT's chats or prompt/completion
  pairs, DPO's and ORPO's preference pairs) with their defaults filled in; ConfigError (one line) for a combination
  that cannot run."""
  if c["dataset_type"] != "grain":
    raise ConfigError(f"{flag}=true reads records from files: set dataset_type=grain (with grain_train_files)")
  train = columns(c, "train_data_columns", allowed, flag)
  c_eval = dict(c, eval_data_columns=c["eval_data_columns"] or list(train))
  evaluation = columns(c_eval, "eval_data_columns", allowed, flag)
  check_chat_template(c)
  if ("messages",) in (train, evaluation) and not c["use_chat_template"]:
    raise ConfigError("train_data_columns=['messages'] needs use_chat_template=true (a chat is rendered by a template)")
  return {"train_data_columns": list(train), "eval_data_columns": list(evaluation)}


def starts_from_a_checkpoint(c: dict[str, Any], flag: str, why: str) -> None:
  if not (c["load_parameters_path"] or c["load_full_state_path"]):
    raise ConfigError(f"{flag}=true needs load_parameters_path (or load_full_state_path): {why}")
