"""Orbax checkpoints of the train state, every process's data iterator state and the config.

Layout: <run_dir>/checkpoints/<step>/{state/, data_iter/process_<i>-of-<n>.json, config/config.json}.
On a local disk orbax writes a step into a temporary directory and renames it once every item is
complete; an object store (gs://) has no atomic rename, so there a step counts only once orbax has
written its commit marker (`commit_success.txt`). Either way a save cut short by a crash is never taken
for the latest step.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from MaxLite import paths
from MaxLite.checkpoint import CONFIG, CONFIG_FILE, DATA_ITER, STATE
from MaxLite.config import Config
from MaxLite.errors import CheckpointError, first_line


class DataIteratorHandler(ocp.CheckpointHandler):
  """Each process writes its own small JSON file; restore reads them all (the caller picks)."""

  def save(self, directory: epath.Path, args: DataIteratorSave) -> None:
    index, count = jax.process_index(), jax.process_count()
    record = {"process_index": index, "process_count": count, "state": args.state}
    (directory / f"process_{index}-of-{count}.json").write_text(json.dumps(record))

  def restore(self, directory: epath.Path, args: DataIteratorRestore | None = None) -> dict[int, Any]:
    records = [json.loads(p.read_text()) for p in sorted(directory.glob("process_*-of-*.json"))]
    return {r["process_index"]: r for r in records}

  def metadata(self, directory: epath.Path) -> None:
    return None


class ConfigHandler(ocp.CheckpointHandler):
  """The config the step was trained with, as indented JSON a person can read (process 0 writes)."""

  def save(self, directory: epath.Path, args: ConfigSave) -> None:
    if jax.process_index() == 0:
      (directory / CONFIG_FILE).write_text(json.dumps(args.config, indent=2, sort_keys=True) + "\n")

  def restore(self, directory: epath.Path, args: ConfigRestore | None = None) -> dict[str, Any]:
    return json.loads((directory / CONFIG_FILE).read_text())

  def metadata(self, directory: epath.Path) -> None:
    return None


@ocp.args.register_with_handler(ConfigHandler, for_save=True)
@dataclasses.dataclass
class ConfigSave(ocp.args.CheckpointArgs):
  config: dict[str, Any]


@ocp.args.register_with_handler(ConfigHandler, for_restore=True)
@dataclasses.dataclass
class ConfigRestore(ocp.args.CheckpointArgs):
  pass


@ocp.args.register_with_handler(DataIteratorHandler, for_save=True)
@dataclasses.dataclass
class DataIteratorSave(ocp.args.CheckpointArgs):
  state: Any


@ocp.args.register_with_handler(DataIteratorHandler, for_restore=True)
@dataclasses.dataclass
class DataIteratorRestore(ocp.args.CheckpointArgs):
  pass


def create_manager(config: Config) -> ocp.CheckpointManager | None:
  if not config.enable_checkpointing:
    return None
  options = ocp.CheckpointManagerOptions(
    # The trainer decides when to save (every checkpoint_period steps, the last step, preemption).
    max_to_keep=None if config.max_num_checkpoints_to_keep == -1 else config.max_num_checkpoints_to_keep,
    enable_async_checkpointing=config.async_checkpointing,
    create=True,
  )
  handlers = {STATE: ocp.StandardCheckpointHandler(), DATA_ITER: DataIteratorHandler(), CONFIG: ConfigHandler()}
  return ocp.CheckpointManager(paths.absolute(config.checkpoint_dir), options=options, item_handlers=handlers)


def save(manager: ocp.CheckpointManager, step: int, state: Any, data_iterator: Any, config: Config) -> None:
  """Start saving `step`; with async on, returns once the arrays are copied off the devices."""
  args = ocp.args.Composite(
    **{
      STATE: ocp.args.StandardSave(state),
      DATA_ITER: DataIteratorSave(data_iterator.get_state()),
      CONFIG: ConfigSave(config.to_dict()),
    }
  )
  manager.save(step, args=args, force=True)


def restore(manager: ocp.CheckpointManager, step: int, target: Any, data_iterator: Any) -> Any:
  """The state of `step` placed as `target` says (shapes, dtypes, current-mesh shardings); also
  moves `data_iterator` to where that step left it."""
  step_dir = paths.join(str(manager.directory), str(step))
  hint = "; move that step directory aside to resume from an earlier one"
  check_compatible(paths.join(step_dir, STATE), target, hint)
  args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target), DATA_ITER: DataIteratorRestore()})
  restored = _read(step_dir, lambda: manager.restore(step, args=args), hint)
  data_iterator.set_state(select_iterator_state(restored[DATA_ITER], step_dir, data_iterator))
  return restored[STATE]


def select_iterator_state(saved: dict[int, Any], step_dir: str, data_iterator: Any) -> Any:
  """This process's saved iterator state; refuses a changed process count unless the input order
  does not depend on it (e.g. synthetic data), so the global data order never silently changes."""
  if not saved:
    raise CheckpointError(f"checkpoint {step_dir} has no data iterator state")
  saved_count = next(iter(saved.values()))["process_count"]
  index, count = jax.process_index(), jax.process_count()
  if saved_count == count and index in saved:
    return saved[index]["state"]
  if getattr(data_iterator, "process_invariant", False):
    return saved[min(saved)]["state"]
  raise CheckpointError(
    f"checkpoint {step_dir} was written by {saved_count} data-loading processes but this run has {count}; "
    f"the data order would change. Resume with {saved_count} processes, or start a new run_name with "
    f"load_full_state_path={step_dir} (keeps model and optimizer, restarts the data)"
  )


def _key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_name(path: tuple[Any, ...]) -> str:
  return ".".join(_key_name(k) for k in path)


def saved_arrays(state_dir: str, hint: str = "") -> dict[str, Any]:
  """{dotted name: array metadata (shape, dtype)} of a saved state item, without reading arrays."""
  tree = _read(state_dir, lambda: ocp.PyTreeCheckpointHandler().metadata(epath.Path(state_dir)).tree, hint)
  return {path_name(p): m for p, m in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_compatible(state_dir: str, target: Any, hint: str = "") -> None:
  """Names the first parameter whose saved shape differs from (or is missing for) this config."""
  saved = saved_arrays(state_dir, hint)
  for path, want in jax.tree_util.tree_flatten_with_path(target)[0]:
    name = path_name(path)
    if name not in saved:
      raise CheckpointError(
        f"checkpoint {state_dir} has no '{name}' (shape {tuple(want.shape)} in this config); "
        "is it from a different model (or scan_layers setting)?"
      )
    if tuple(saved[name].shape) != tuple(want.shape):
      raise CheckpointError(
        f"checkpoint {state_dir}: '{name}' has shape {tuple(saved[name].shape)} in the "
        f"checkpoint but {tuple(want.shape)} in this config"
      )


# What orbax writes last into a step on an object store (where it cannot rename a finished directory).
COMMIT_MARKER = "commit_success.txt"


def is_finalized(step_dir: str) -> bool:
  """A local step directory exists only once complete; a gs:// one needs its commit marker."""
  return not paths.is_url(step_dir) or paths.exists(paths.join(step_dir, COMMIT_MARKER))


def step_numbers(directory: str) -> list[int]:
  """Complete steps in a checkpoints directory, ascending (in-progress saves are `<step>.orbax-checkpoint-tmp*`
  on disk and steps without a commit marker on gs://)."""
  names = [name for name in paths.listdir(directory) if name.isdigit()]
  return sorted(int(name) for name in names if is_finalized(paths.join(directory, name)))


def incomplete_saves(directory: str) -> list[str]:
  """Names of saves a crash cut short: orbax's temporary directories, or gs:// steps without a commit marker."""
  names = paths.listdir(directory)
  finished = {str(s) for s in step_numbers(directory)}
  return sorted(n for n in names if "tmp" in n or (n.isdigit() and n not in finished))


def resolve_state_dir(path: str, key: str) -> str:
  """A load path may name a step directory (…/checkpoints/100) or its state item (…/100/state)."""
  path = paths.absolute(path).rstrip("/")
  try:
    found = paths.isdir(path)
  except Exception as e:  # an unreachable bucket or missing credentials
    raise CheckpointError(f"{key}={path}: cannot read it ({type(e).__name__}: {first_line(e)})") from None
  if not found:
    raise CheckpointError(f"{key}={path}: no such directory")
  if paths.isdir(paths.join(path, STATE)):
    if not is_finalized(path):
      raise CheckpointError(f"{key}={path}: this save was never completed (no {COMMIT_MARKER})")
    return paths.join(path, STATE)
  if paths.exists(paths.join(path, "_METADATA")):
    return path
  steps = step_numbers(path)[::-1]
  hint = f" (it holds steps {steps[:5]}; use e.g. {paths.join(path, str(steps[0]))})" if steps else ""
  raise CheckpointError(f"{key}={path} is not a checkpoint step directory{hint}")


def load_params(path: str, target_params: Any) -> Any:
  """Only the params of a checkpoint (a full train state or a params-only export)."""
  state_dir = resolve_state_dir(path, "load_parameters_path")
  target = {"params": target_params}
  check_compatible(state_dir, target)
  args = ocp.args.PyTreeRestore(
    item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
  )
  with ocp.PyTreeCheckpointer() as checkpointer:
    return _read(state_dir, lambda: checkpointer.restore(state_dir, args=args))["params"]


def load_full_state(path: str, target: Any) -> Any:
  state_dir = resolve_state_dir(path, "load_full_state_path")
  check_compatible(state_dir, target)
  with ocp.StandardCheckpointer() as checkpointer:
    return _read(state_dir, lambda: checkpointer.restore(state_dir, target))


def sharded_target(abstract: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _read(where: str, fn: Any, hint: str = "") -> Any:
  try:
    return fn()
  except CheckpointError:
    raise
  except Exception as e:  # orbax and tensorstore raise many types for unreadable files
    raise CheckpointError(f"checkpoint {where} could not be read ({first_line(e, with_type=True)}){hint}") from e
