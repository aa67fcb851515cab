"""Where a checkpoint step keeps its parts: `<step>/{state/, data_iter/process_<i>-of-<n>.json, config/config.json}`,
which steps of a checkpoints folder are complete, and where emergency checkpoints keep each step's data positions.

These names are the one description of that layout; the config loader reads a run's newest step and its saved config
through them (without importing the checkpoint package, which needs jax and orbax), the checkpoint package writes them.
"""

from MaxLite import storage

STATE, DATA_ITER, CONFIG = "state", "data_iter", "config"
CONFIG_FILE = "config.json"
COMMIT_MARKER = "commit_success.txt"  # orbax's: a gs:// step is complete once it exists
DATA_POSITIONS = "data_positions"  # emergency checkpoints: <run_dir>/data_positions/<step>/ (and its config)


def step_dir_of(path: str) -> str:
  """The step directory of `path`, which names a step directory or its `state/` item."""
  path = storage.absolute(path).rstrip("/")
  return storage.dirname(path) if storage.basename(path) == STATE else path


def saved_config_path(step_dir: str) -> str:
  """Where a step keeps the config it was trained with (converted checkpoints: the model keys)."""
  return storage.join(step_dir, CONFIG, CONFIG_FILE)


def is_finalized(step_dir: str) -> bool:
  """A local step directory exists only once complete; a gs:// one needs its commit marker."""
  return not storage.is_url(step_dir) or storage.exists(storage.join(step_dir, COMMIT_MARKER))


def newest_step(path: str) -> str:
  """`path` itself when it names a step (or anything else); the newest complete step when it names a checkpoints
  folder or a run folder holding one, so a README command reads `.../checkpoints` whatever the run's last step was.
  Explicit steps stay the way to pin one."""
  path = path.rstrip("/")
  if not path or not storage.isdir(path) or storage.isdir(storage.join(path, STATE)):
    return path
  if storage.exists(storage.join(path, "_METADATA")):  # a params-only export: orbax's own step item
    return path
  folder = storage.join(path, "checkpoints") if storage.isdir(storage.join(path, "checkpoints")) else path
  steps = step_numbers(folder)
  return storage.join(folder, str(steps[-1])) if steps else path


def step_numbers(directory: str) -> list[int]:
  """Complete steps in a checkpoints directory, ascending (in-progress saves are `<step>.orbax-checkpoint-tmp*`
  on disk and steps without a commit marker on gs://)."""
  names = [name for name in storage.listdir(directory) if name.isdigit()]
  return sorted(int(name) for name in names if is_finalized(storage.join(directory, name)))
