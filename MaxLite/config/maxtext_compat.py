"""MaxText's key names: old MaxLite names that map onto them, and MaxText keys MaxLite does not have.

A MaxText command copied into MaxLite should either work or say exactly which key is missing, never
"unknown key". Renamed keys and values are accepted for one release with a deprecation warning.
"""

from __future__ import annotations

import functools
import os

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
