"""The tokenizer travels with a checkpoint as its model keys do: decode.py and to_hf read a step's saved config for the
tokenizer keys the command line and config file leave unset, and refuse a tokenizer whose ids the model cannot embed.

A run's saved tokenizer_path may be relative to the directory it was trained from; it is looked up from that training
directory (worked out from the saved run_dir and base_output_directory), then from the working directory, then under
the shipped files' root (`assets/...`). A path found nowhere is one error line naming the places tried.
"""

from __future__ import annotations

import json
import os
from typing import Any

from MaxLite import storage
from MaxLite.cli.errors import InputError
from MaxLite.config import schema
from MaxLite.storage.layout import saved_config_path, step_dir_of

# The keys that define the ids a model was trained on and the text around them.
TOKENIZER_KEYS = ("tokenizer_type", "tokenizer_path", "add_bos", "add_eos", "chat_template_path")
_PATH_KEYS = ("tokenizer_path", "chat_template_path")
_FIX = {
  "tokenizer_path": "pass the run's tokenizer with tokenizer_type=... tokenizer_path=...",
  "chat_template_path": 'pass its template with chat_template_path=... ("" = the tokenizer\'s)',
}


def saved_config(path: str) -> dict[str, Any] | None:
  """The config saved with the checkpoint step `path` names (…/<step> or …/<step>/state), if it has one."""
  if not path:
    return None
  saved = saved_config_path(step_dir_of(path))
  try:
    if not storage.isfile(saved):
      return None
    stored = json.loads(storage.read_text(saved))
  except Exception:  # unreadable: the checkpoint read that follows names the problem
    return None
  return stored if isinstance(stored, dict) else None


def _training_directory(stored: dict[str, Any]) -> str | None:
  """The working directory a run was trained from, when its saved run_dir (absolute) ends with its relative
  base_output_directory/run_name."""
  base, run_dir, name = (stored.get(k) for k in ("base_output_directory", "run_dir", "run_name"))
  if not (isinstance(base, str) and isinstance(run_dir, str) and isinstance(name, str)) or not base or not run_dir:
    return None
  if os.path.isabs(base) or storage.is_url(base) or storage.is_url(run_dir):
    return None
  suffix = os.path.normpath(os.path.join(base, name))
  run_dir = os.path.normpath(run_dir)
  if not run_dir.endswith(os.sep + suffix):
    return None
  return run_dir[: -len(suffix) - 1] or os.sep


def _locate(key: str, value: str, stored: dict[str, Any], origin: str) -> str:
  """A saved relative path as it exists here (see the module's docstring); InputError naming the places tried."""
  if not value or storage.is_url(value) or os.path.isabs(os.path.expanduser(value)):
    if value and not storage.is_url(value) and not os.path.exists(os.path.expanduser(value)):
      raise InputError(f"{key}={value} {origin} does not exist (tried {value}): {_FIX[key]}")
    return value
  trained_in = _training_directory(stored)  # where the run read it, first: the file it was trained with
  places = [os.path.join(trained_in, value)] if trained_in else []
  places += [os.path.abspath(value), os.path.join(storage.bundled_root(), value)]
  for place in dict.fromkeys(places):
    if os.path.exists(place):
      return place
  raise InputError(f"{key}={value} {origin} does not exist (tried {', '.join(dict.fromkeys(places))}): {_FIX[key]}")


def take_from_checkpoint(raw: dict[str, Any]) -> str | None:
  """In `config.load_raw`'s dict: the tokenizer keys nobody set explicitly take the values saved with the checkpoint
  load_parameters_path names, as its model keys do; explicit ones win. Returns where they came from ("from the
  checkpoint …") when any did, else None (no checkpoint, one saved without them, as converted steps are, or a run
  trained on synthetic ids)."""
  path = raw.get("load_parameters_path") or raw.get("load_full_state_path")
  stored = saved_config(path)
  if not stored or not any(k in stored for k in TOKENIZER_KEYS):
    return None
  if stored.get("dataset_type") == "synthetic":  # (GRPO refuses synthetic data: it reads prompt files)
    return None  # a run on synthetic ids never read text: its tokenizer keys are the defaults, not its tokenizer
  step_dir = step_dir_of(path)
  origin = f"(from the checkpoint {step_dir})"
  explicit = set(raw.get("explicit_keys", ()))
  taken = False
  for key in TOKENIZER_KEYS:
    if key in stored and key not in explicit:
      value = schema.coerce(key, stored[key], f"from the checkpoint {step_dir}")
      raw[key] = _locate(key, value, stored, origin) if key in _PATH_KEYS else value
      taken = True
  return origin if taken else None


def check_vocabulary(tokenizer: Any, config: Any, origin: str | None) -> None:
  """InputError (one line naming both) when the tokenizer gives ids the model has no embedding row for, or when a
  loaded checkpoint names no tokenizer (a converted step) and the default one's vocabulary is not the model's."""
  explicit = "tokenizer_path" in config.explicit_keys
  if not (explicit or origin) and config.load_parameters_path and tokenizer.vocab_size != config.vocab_size:
    raise InputError(
      f"the checkpoint {config.load_parameters_path} names no tokenizer, and the default tokenizer_path="
      f"{config.tokenizer_path} has {tokenizer.vocab_size} tokens where the model has vocab_size={config.vocab_size}: "
      "it is not the model's tokenizer; pass the model's own (tokenizer_type=... tokenizer_path=...)"
    )
  if tokenizer.vocab_size <= config.vocab_size:
    return
  where = "(set explicitly)" if explicit else origin or "(the default)"
  raise InputError(
    f"tokenizer_path={config.tokenizer_path} {where} has {tokenizer.vocab_size} tokens, more than the model's "
    f"vocab_size={config.vocab_size}: ids past {config.vocab_size - 1} have no embedding, so this is not the model's "
    "tokenizer; pass the one it was trained with (tokenizer_type=... tokenizer_path=...)"
  )
