"""The run's configuration: YAML and `key=value` overrides in, one validated, frozen `Config` out.

`choices` (the closed sets of values, jax-free) is the bottom of the package; `maxtext_compat` maps MaxText's key
names; `loader` reads and types the keys; `validation` checks them and derives the rest (mesh, batch, run
directories); `attention_choice` and `splash_blocks` decide the attention kernel and its tiles at load time.
"""

from typing import Any

# The loader's names, imported at first use: `MaxLite` imports this package for `families` in every process, the
# one that only re-execs itself under tcmalloc included, which should not pay for pydantic and the schema (0.12 s).
_LOADER_NAMES = (
  "BASE_CONFIG_PATH",
  "MODEL_KEYS",
  "Config",
  "available_models",
  "build",
  "checkpoint_model_settings",
  "load_config",
  "load_raw",
  "parse_overrides",
)
__all__ = list(_LOADER_NAMES)


def __getattr__(name: str) -> Any:
  if name in _LOADER_NAMES:
    from MaxLite.config import loader

    return getattr(loader, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
