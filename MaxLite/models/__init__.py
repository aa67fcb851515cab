"""The decoder families, by MaxText's `decoder_block` values: each module of this package registers one `Family`
(its layer, parameter count, FLOPs and Hugging Face name map) in the registry (config/families.py) when this package
is imported, so adding a family is adding a module here (and to the import below), a `configs/models/` file and its
tests. The README's "Add a model family" walks through one (gemma3.py).
"""

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
)

# Each import registers its family (last: the modules use the names above).
from MaxLite.models import deepseek, gemma3, llama  # noqa: E402

__all__ = [
  "Family",
  "HfLayout",
  "Stack",
  "architectures",
  "decoder_blocks",
  "deepseek",
  "family",
  "family_for_architecture",
  "gemma3",
  "llama",
  "one_stack",
  "register",
]
