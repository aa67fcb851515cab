"""Checkpoints: the orbax manager, what a checkpoint holds, Hugging Face conversion, safetensors.

A step directory is `<step>/{state/, data_iter/process_<i>-of-<n>.json, config/config.json}`; these
names are the one description of that layout.
"""

from MaxLite import paths

STATE, DATA_ITER, CONFIG = "state", "data_iter", "config"
CONFIG_FILE = "config.json"


def step_dir_of(path: str) -> str:
  """The step directory of `path`, which names a step directory or its `state/` item."""
  path = paths.absolute(path).rstrip("/")
  return paths.dirname(path) if paths.basename(path) == STATE else path


def saved_config_path(step_dir: str) -> str:
  """Where a step keeps the config it was trained with (converted checkpoints: the model keys)."""
  return paths.join(step_dir, CONFIG, CONFIG_FILE)
