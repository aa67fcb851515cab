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


# MaxText's nested groups: `name:` in a YAML file (or name.KEY=VALUE on the command line) sets the keys of the schema
# groups that declare `nested_under = name` (a ClassVar: Grpo under rl, Dpo and Orpo under dpo), and how an error
# calls such a key. A key MaxText spells otherwise there says so in its Field (json_schema_extra "nested_as": dpo_algo
# is dpo.algo).
NESTED = {"rl": "an RL", "dpo": "a DPO"}


def nested_groups(group: str) -> list[str]:
  return [g.__name__ for g in schema.GROUPS if getattr(g, "nested_under", None) == group]


def nested_keys(group: str) -> dict[str, str]:
  """{name as written under `group:` -> MaxLite's key} for MaxText's nested group `rl` or `dpo`."""
  groups = nested_groups(group)
  keys = {key: key for key, g in schema.GROUP_OF.items() if g.__name__ in groups}
  extras = {key: schema.FIELDS[key].json_schema_extra for key in keys}
  spelled = {
    extra["nested_as"]: key for key, extra in extras.items() if isinstance(extra, dict) and "nested_as" in extra
  }
  return keys | spelled


def rl_keys() -> tuple[str, ...]:
  """The keys `rl:` / rl.KEY may set: the Grpo group's (MaxText's rl keys MaxLite has)."""
  return tuple(nested_keys("rl"))


def flatten_nested(updates: dict[str, Any], source: str = "") -> dict[str, Any]:
  """MaxText's post_train/rl.yml groups its GRPO keys under `rl:` and post_train/dpo.yml its DPO/ORPO keys under
  `dpo:` (and its commands set them as rl.KEY=VALUE, dpo.KEY=VALUE); MaxLite holds them at the top level, as MaxText's
  older configs did, so both spellings set the same key (dpo.algo is dpo_algo). rl.yml's `epsilon_high: null`
  (= grpo_epsilon) is MaxLite's -1. Only a group's keys (and MaxText's keys MaxLite lacks, named as such by the
  loader) may be spelled so: `rl.steps=5` is refused, never taken as the run's `steps`."""
  out: dict[str, Any] = {}
  for key, value in updates.items():
    group = key.split(".", 1)[0]
    if group in NESTED and key == group and isinstance(value, dict):
      nested = [(str(name), item) for name, item in value.items()]
    elif group in NESTED and key.startswith(group + "."):
      nested = [(key[len(group) + 1 :], value)]
    else:
      out[key] = value
      continue
    allowed, label = nested_keys(group), NESTED[group]
    holds = ", ".join(f"--describe {g}" for g in nested_groups(group))
    for name, item in nested:
      if name not in allowed and name not in unimplemented():
        where = f" ({source})" if source else ""
        top = f"; {name} is a top-level key: write {name}={item}" if _is_config_key(name) else ""
        raise ConfigError(
          f"{group}.{name}={item}{where} is not {label} key: the {group} group holds only its own ({holds}){top}"
        )
      name = allowed.get(name, name)
      out[name] = -1.0 if name == "epsilon_high" and item in (None, "null", "None") else item
  return out


def _is_config_key(name: Any) -> bool:
  return name in schema.FIELDS or name in RENAMED
