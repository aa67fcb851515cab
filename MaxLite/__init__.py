"""MaxLite: a small MaxText-style LLM pretraining codebase on JAX."""

from MaxLite import storage as _paths
from MaxLite.runtime import platforms as _platforms

# Before any storage library reads its settings: a local GCS server named by STORAGE_EMULATOR_HOST
# reaches every layer (see storage.use_storage_emulator_if_set).
_paths.use_storage_emulator_if_set()
# Before jax starts a backend: on a machine that can only use its CPU, no TPU probe and no log line about its failure.
_platforms.use_cpu_when_it_is_all_there_is()
# Last, once the environment is set: the decoder families register into config/families.py, which config validation
# and the transformer read (torchtitan's way: importing the package brings its models).
import MaxLite.models  # noqa: E402, F401
