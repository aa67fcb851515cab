"""The run's configuration: YAML and `key=value` overrides in, one validated, frozen `Config` out.

`choices` (the closed sets of values, jax-free) is the bottom of the package; `maxtext_compat` maps MaxText's key
names; `loader` reads and types the keys; `validation` checks them and derives the rest (mesh, batch, run
directories); `attention_choice` and `splash_blocks` decide the attention kernel and its tiles at load time.
"""

from MaxLite.config.loader import (
  BASE_CONFIG_PATH,
  MODEL_KEYS,
  Config,
  available_models,
  build,
  checkpoint_model_settings,
  coerce,
  load_config,
  load_raw,
  parse_overrides,
)

__all__ = [
  "BASE_CONFIG_PATH",
  "MODEL_KEYS",
  "Config",
  "available_models",
  "build",
  "checkpoint_model_settings",
  "coerce",
  "load_config",
  "load_raw",
  "parse_overrides",
]
