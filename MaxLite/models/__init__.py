"""The decoder families, by MaxText's `decoder_block` values: each family module of this package registers one
`Family` (its layer, parameter count, FLOPs and Hugging Face name map) in the registry (config/families.py), so adding
a family is adding a module here (and its name to FAMILY_MODULES), a `configs/models/` file and its tests. The README's
"Add a model family" walks through one (gemma3.py).

Importing this package brings no jax or flax: the family modules are imported at the registry's first lookup (the
loader below), and a family's own config keys sit in a jax-free module of their own, listed in KEY_GROUPS, which the
schema reads (config/key_groups.py; `--help` reads it before any runtime starts).
"""

import importlib
from typing import Any

from MaxLite.config.families import (
  Family,
  HfLayout,
  Stack,
  architectures,
  decoder_blocks,
  family,
  family_for_architecture,
  one_stack,
  register,
  register_loader,
)
from MaxLite.models.gpt_oss_keys import GptOss

# Each module registers its family when imported.
FAMILY_MODULES = ("deepseek", "gemma3", "gpt_oss", "llama")
# The families' own key groups (pydantic), after the shared ones in the schema.
KEY_GROUPS = (GptOss,)


def _import_families() -> None:
  for name in FAMILY_MODULES:
    importlib.import_module(f"{__name__}.{name}")


register_loader(_import_families)


def __getattr__(name: str) -> Any:
  """`models.gemma3` and the like: the family module, imported at first use."""
  if name in FAMILY_MODULES:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
  "FAMILY_MODULES",
  "KEY_GROUPS",
  "Family",
  "HfLayout",
  "Stack",
  "architectures",
  "decoder_blocks",
  "family",
  "family_for_architecture",
  "one_stack",
  "register",
]
