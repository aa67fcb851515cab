"""Where a checkpoint step keeps its parts: `<step>/{state/, data_iter/process_<i>-of-<n>.json, config/config.json}`.

These names are the one description of that layout; the config loader reads a step's saved config through them, the
checkpoint package writes them.
"""

from MaxLite import storage

STATE, DATA_ITER, CONFIG = "state", "data_iter", "config"
CONFIG_FILE = "config.json"


def step_dir_of(path: str) -> str:
  """The step directory of `path`, which names a step directory or its `state/` item."""
  path = storage.absolute(path).rstrip("/")
  return storage.dirname(path) if storage.basename(path) == STATE else path


def saved_config_path(step_dir: str) -> str:
  """Where a step keeps the config it was trained with (converted checkpoints: the model keys)."""
  return storage.join(step_dir, CONFIG, CONFIG_FILE)
