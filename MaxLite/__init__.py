"""MaxLite: a small MaxText-style LLM pretraining codebase on JAX."""

from MaxLite import storage as _paths

# Before any storage library reads its settings: a local GCS server named by STORAGE_EMULATOR_HOST
# reaches every layer (see storage.use_storage_emulator_if_set).
_paths.use_storage_emulator_if_set()
