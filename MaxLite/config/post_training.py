"""The post-training keys (MaxText's): use_sft, use_dpo, use_grpo and what their data needs. Pure checks on the raw
dict.

`data_kind(columns)` tells the input pipeline what a record is: "text" (pretraining documents), "chat" (a `messages`
list), "prompt_completion" or "preference" (chosen/rejected, optionally with a shared prompt). GRPO reads "prompts":
records whose first column is the prompt and whose other columns go to the reward functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from MaxLite.cli.errors import ConfigError
from MaxLite.config.choices import DPO_COLUMNS, GRPO_SHIPPED_EVAL, GRPO_SHIPPED_TRAIN, SFT_COLUMNS


def _columns(c: dict[str, Any], key: str, allowed: tuple[tuple[str, ...], ...], what: str) -> tuple[str, ...]:
  columns = tuple(c[key]) or allowed[0]
  if columns not in allowed:
    shown = " or ".join(str(list(a)) for a in allowed)
    raise ConfigError(f"{key}={list(c[key])} does not fit {what}; use {shown}")
  return columns


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


def record_kind(c: Mapping[str, Any]) -> str:
  """data_kind of a config `derive` checked: "prompts" for GRPO, else what the training columns hold."""
  if c["use_grpo"]:
    return "prompts"
  return data_kind(c["train_data_columns"]) if c["use_sft"] or c["use_dpo"] else "text"


def derive(c: dict[str, Any]) -> dict[str, Any]:
  """train_data_columns / eval_data_columns with their defaults filled in (GRPO: its data files too); ConfigError
  (one line) for a combination that cannot run."""
  if c["use_grpo"]:
    return _derive_grpo(c)
  if c["use_sft"] and c["use_dpo"]:
    raise ConfigError("use_sft=true and use_dpo=true: choose one (SFT first, then DPO from its checkpoint)")
  if not (c["use_sft"] or c["use_dpo"]):
    for key in ("train_data_columns", "eval_data_columns"):
      if len(c[key]) > 1:
        raise ConfigError(f"{key}={list(c[key])}: pretraining reads one text column; set use_sft or use_dpo")
    for key in ("use_chat_template", "sft_train_on_completion_only"):
      if c[key]:
        raise ConfigError(f"{key}=true needs use_sft=true or use_dpo=true (pretraining reads plain text)")
    return {}  # the text column is train_data_columns[0], else grain_text_column
  if c["dataset_type"] != "grain":
    raise ConfigError("use_sft/use_dpo read records from files: set dataset_type=grain (with grain_train_files)")
  allowed, what = (SFT_COLUMNS, "use_sft") if c["use_sft"] else (DPO_COLUMNS, "use_dpo")
  train = _columns(c, "train_data_columns", allowed, what)
  c_eval = dict(c, eval_data_columns=c["eval_data_columns"] or list(train))
  evaluation = _columns(c_eval, "eval_data_columns", allowed, what)
  if c["use_chat_template"] and c["tokenizer_type"] != "huggingface":
    raise ConfigError(
      f"use_chat_template=true needs tokenizer_type=huggingface (a tokenizer.json directory with its chat template), "
      f"got {c['tokenizer_type']!r}"
    )
  if ("messages",) in (train, evaluation) and not c["use_chat_template"]:
    raise ConfigError("train_data_columns=['messages'] needs use_chat_template=true (a chat is rendered by a template)")
  if c["use_dpo"]:
    if not (c["load_parameters_path"] or c["load_full_state_path"]):
      raise ConfigError(
        "use_dpo=true needs load_parameters_path (or load_full_state_path): the loaded parameters are the frozen "
        "reference model and the start"
      )
    if c["num_vocab_tiling"] > 1:
      raise ConfigError("use_dpo=true needs num_vocab_tiling=1 (DPO sums log-probabilities per response)")
    if not 0.0 <= c["dpo_label_smoothing"] < 0.5:
      raise ConfigError(f"dpo_label_smoothing must be in [0, 0.5), got {c['dpo_label_smoothing']}")
    if c["dpo_beta"] <= 0:
      raise ConfigError(f"dpo_beta must be positive, got {c['dpo_beta']}")
  return {"train_data_columns": list(train), "eval_data_columns": list(evaluation)}


# decode.py's sampling keys -> GRPO's own (keys_train.Grpo); TRL's defaults for GRPO's.
GRPO_ROLLOUT_KEYS = {
  "decode_sampling_temperature": "rollout_temperature",
  "decode_sampling_top_k": "rollout_top_k",
  "decode_sampling_nucleus_p": "rollout_top_p",
}
GRPO_ROLLOUT_DEFAULTS = {"rollout_temperature": 1.0, "rollout_top_k": 0, "rollout_top_p": 1.0}


def _derive_grpo(c: dict[str, Any]) -> dict[str, Any]:
  """GRPO's data: the user's prompt files, or with none named the shipped arithmetic problems (prompt + answer)."""
  for other in ("use_sft", "use_dpo"):
    if c[other]:
      raise ConfigError(f"use_grpo=true and {other}=true: choose one (SFT first, then GRPO from its checkpoint)")
  if c["dataset_type"] != "grain":
    raise ConfigError("use_grpo=true reads prompts from files: set dataset_type=grain (with grain_train_files)")
  out: dict[str, Any] = {}
  explicit = set(c.get("explicit_keys", ()))
  for decode_key, rollout_key in GRPO_ROLLOUT_KEYS.items():  # decode.py's keys, which MaxText's rl.yml reuses
    if decode_key in explicit:
      raise ConfigError(
        f"use_grpo=true samples its rollouts with {rollout_key} (TRL's default {GRPO_ROLLOUT_DEFAULTS[rollout_key]}), "
        f"not {decode_key} (decode.py's): write {rollout_key}={c[decode_key]}"
      )
  if "grain_train_files" not in explicit:
    out.update(grain_train_files=GRPO_SHIPPED_TRAIN, grain_file_type="jsonl")
    if "grain_eval_files" not in explicit:
      out["grain_eval_files"] = GRPO_SHIPPED_EVAL
  shipped = out.get("grain_train_files", c["grain_train_files"]) == GRPO_SHIPPED_TRAIN
  if not shipped and "reward_functions" not in explicit:
    raise ConfigError(
      "use_grpo=true on your own prompts (grain_train_files) needs reward_functions (module:function entries): "
      "the default ones score the shipped arithmetic problems"
    )
  default_columns = ["prompt", "answer"] if shipped else ["prompt"]
  train = list(c["train_data_columns"]) or default_columns
  out.update(train_data_columns=train, eval_data_columns=list(c["eval_data_columns"]) or train)
  if c["use_chat_template"] and c["tokenizer_type"] != "huggingface":
    raise ConfigError(
      f"use_chat_template=true needs tokenizer_type=huggingface (a tokenizer.json directory with its chat template), "
      f"got {c['tokenizer_type']!r}"
    )
  if c["num_vocab_tiling"] > 1:
    raise ConfigError("use_grpo=true needs num_vocab_tiling=1 (GRPO reads every completion token's log-probability)")
  if c["max_prefill_predict_length"] + c["max_decode_steps"] > c["max_target_length"]:
    raise ConfigError(
      f"use_grpo=true: max_prefill_predict_length={c['max_prefill_predict_length']} (the prompt) + "
      f"max_decode_steps={c['max_decode_steps']} (the completion) exceeds max_target_length={c['max_target_length']}"
    )
  return out
