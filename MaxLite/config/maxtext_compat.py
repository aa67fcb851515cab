"""MaxText's key names: old MaxLite names that map onto them, and MaxText keys MaxLite does not have.

A MaxText command copied into MaxLite should either work or say exactly which key is missing, never
"unknown key". Renamed keys and values are accepted for one release with a deprecation warning.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from MaxLite import storage
from MaxLite.cli.errors import ConfigError
from MaxLite.config import schema

# Old MaxLite name -> MaxText's name for the same setting.
RENAMED = {
  "decode_sampling": "decode_sampling_strategy",
  "max_prefill_length": "max_prefill_predict_length",
  "max_checkpoints_to_keep": "max_num_checkpoints_to_keep",
  "print_sharding": "debug_sharding",
  "cosine_learning_rate_final_fraction": "learning_rate_final_fraction",
  "param_init_scale": "dense_init_scale",
}

# Key -> {old MaxLite value: MaxText's value}.
RENAMED_VALUES = {"decode_sampling_strategy": {"temperature": "weighted", "top_k": "topk"}}


@functools.cache
def unimplemented() -> frozenset[str]:
  """MaxText's keys that MaxLite lacks (configs/maxtext_unimplemented.txt)."""
  with open(os.path.join(storage.configs_dir(), "maxtext_unimplemented.txt"), encoding="utf-8") as f:
    return frozenset(line.strip() for line in f if line.strip() and not line.startswith("#"))


def rl_keys() -> tuple[str, ...]:
  """The keys `rl:` / rl.KEY may set: the Grpo group's (MaxText's rl keys MaxLite has)."""
  return tuple(key for key, group in schema.GROUP_OF.items() if group.__name__ == "Grpo")


def flatten_rl(updates: dict[str, Any], source: str = "") -> dict[str, Any]:
  """MaxText's post_train/rl.yml groups its GRPO keys under `rl:` (and its commands set them as rl.KEY=VALUE); MaxLite
  holds them at the top level, as MaxText's older GRPO configs did, so both spellings set the same key. rl.yml's
  `epsilon_high: null` (= grpo_epsilon) is MaxLite's -1. Only RL keys (and MaxText's RL keys MaxLite lacks, named as
  such by the loader) may be spelled so: `rl.steps=5` is refused, never taken as the run's `steps`."""
  out: dict[str, Any] = {}
  allowed = rl_keys()
  for key, value in updates.items():
    if key == "rl" and isinstance(value, dict):
      nested = [(str(name), item) for name, item in value.items()]
    elif key.startswith("rl."):
      nested = [(key[len("rl.") :], value)]
    else:
      out[key] = value
      continue
    for name, item in nested:
      if name not in allowed and name not in unimplemented():
        where = f" ({source})" if source else ""
        top = f"; {name} is a top-level key: write {name}={item}" if _is_config_key(name) else ""
        raise ConfigError(
          f"rl.{name}={item}{where} is not an RL key: the rl group holds only GRPO's keys (--describe Grpo){top}"
        )
      out[name] = -1.0 if name == "epsilon_high" and item in (None, "null", "None") else item
  return out


def _is_config_key(name: Any) -> bool:
  return name in schema.FIELDS or name in RENAMED
