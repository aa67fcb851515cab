"""MaxLite: a small MaxText-style LLM pretraining codebase on JAX."""

import importlib

from MaxLite import storage as _paths
from MaxLite.config import families as _families
from MaxLite.config import key_groups as _key_groups
from MaxLite.config import objectives as _objectives
from MaxLite.runtime import platforms as _platforms

# Before any storage library reads its settings: a local GCS server named by STORAGE_EMULATOR_HOST
# reaches every layer (see storage.use_storage_emulator_if_set).
_paths.use_storage_emulator_if_set()
# Before jax starts a backend: on a machine that can only use its CPU, no TPU probe and no log line about its failure.
_platforms.use_cpu_when_it_is_all_there_is()
# The decoder families register into config/families.py at its first lookup (config validation, the transformer):
# MaxLite.models brings jax and flax, which a process that never looks a family up (train.py's first one, which
# only re-execs itself under tcmalloc; a tool's --help) should not pay for.
_families.register_loader(lambda: importlib.import_module("MaxLite.models"))
# The objectives declare their keys beside their losses; the schema reads them without importing jax.
_key_groups.add_source("MaxLite.objectives")
_key_groups.add_source("MaxLite.models")
_objectives.register_loader(lambda: importlib.import_module("MaxLite.objectives"))
