"""MaxText's key names: old MaxLite names that map onto them, and MaxText keys MaxLite does not have.

A MaxText command copied into MaxLite should either work or say exactly which key is missing, never
"unknown key". Renamed keys and values are accepted for one release with a deprecation warning.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from MaxLite import storage

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


def flatten_rl(updates: dict[str, Any]) -> dict[str, Any]:
  """MaxText's post_train/rl.yml groups its GRPO keys under `rl:` (and its commands set them as rl.KEY=VALUE); MaxLite
  holds them at the top level, as MaxText's older GRPO configs did, so both spellings set the same key. rl.yml's
  `epsilon_high: null` (= grpo_epsilon) is MaxLite's -1."""
  out: dict[str, Any] = {}
  for key, value in updates.items():
    if key == "rl" and isinstance(value, dict):
      nested = value.items()
    elif key.startswith("rl."):
      nested = [(key[len("rl.") :], value)]
    else:
      out[key] = value
      continue
    for name, item in nested:
      out[name] = -1.0 if name == "epsilon_high" and item in (None, "null", "None") else item
  return out
