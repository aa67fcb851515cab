"""Orbax checkpoints of the train state, every process's data iterator state and the config.

Layout: <run_dir>/checkpoints/<step>/{state/, data_iter/process_<i>-of-<n>.json, config/config.json}.
On a local disk orbax writes a step into a temporary directory and renames it once every item is
complete; an object store (gs://) has no atomic rename, so there a step counts only once orbax has
written its commit marker (`commit_success.txt`). Either way a save cut short by a crash is never taken
for the latest step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging as std_logging
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from MaxLite import storage
from MaxLite.checkpoint import CONFIG, CONFIG_FILE, DATA_ITER, STATE, agreement
from MaxLite.checkpoint.reads import DamagedFileError, UnreadableCheckpointError, read
from MaxLite.cli.errors import CheckpointError, InputError, first_line
from MaxLite.config import Config
from MaxLite.storage.layout import COMMIT_MARKER, is_finalized, step_numbers


class DataIteratorHandler(ocp.CheckpointHandler):
  """Each process writes its own small JSON file; restore reads them all (the caller picks)."""

  def save(self, directory: epath.Path, args: DataIteratorSave) -> None:
    index, count = jax.process_index(), jax.process_count()
    record = {"process_index": index, "process_count": count, "state": args.state}
    (directory / f"process_{index}-of-{count}.json").write_text(json.dumps(record))

  def restore(self, directory: epath.Path, args: DataIteratorRestore | None = None) -> dict[int, Any]:
    records = [json.loads(p.read_text()) for p in sorted(directory.glob("process_*-of-*.json"))]
    if not records:  # every save writes at least process 0's file: the step lost its files
      raise FileNotFoundError(f"no process_*-of-*.json in {directory}")
    missing = [
      p.name for p, r in zip(sorted(directory.glob("process_*-of-*.json")), records) if "process_index" not in r
    ]
    if missing:
      raise DamagedFileError(f"{directory}: {', '.join(missing)} has no process_index")
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
  return ocp.CheckpointManager(storage.absolute(config.checkpoint_dir), options=options, item_handlers=handlers)


def save(manager: Any, step: int, state: Any, data_iterator: Any, config: Config, force: bool = True) -> None:
  """Start saving `step`; with async on, returns once the arrays are copied off the devices. An emergency
  manager (checkpoint/emergency.py) saves on the tiers whose period `step` is, or on all when `force`."""
  if not isinstance(manager, ocp.CheckpointManager):
    manager.save(step, state, data_iterator, config, force)
    return
  args = ocp.args.Composite(
    **{
      STATE: ocp.args.StandardSave(state),
      DATA_ITER: DataIteratorSave(data_iterator.get_state()),
      CONFIG: ConfigSave(config.to_dict()),
    }
  )
  manager.save(step, args=args, force=True)


class _FailedWriteTasks(std_logging.Filter):
  """Drops asyncio's "exception was never retrieved" records of a failed save's other write tasks. They fail the
  same way as the one the save reports, and asyncio logs each one's traceback when it is garbage-collected (at exit,
  under load), after the one line the save's error becomes. Such a record carries an exception of a type in that
  error's chain and names a file of the step (`<dir>/<step>/...` or orbax's `<dir>/<step>.orbax-checkpoint-tmp...`,
  in any tier's directory); every other asyncio record still comes out."""

  def __init__(self) -> None:
    super().__init__()
    self._failures: list[tuple[re.Pattern[str], tuple[type[BaseException], ...]]] = []

  def add(self, step: int, error: BaseException) -> None:
    types, seen, cause = [], set(), error
    while cause is not None and id(cause) not in seen:
      seen.add(id(cause))
      types.append(type(cause))
      cause = cause.__cause__ or cause.__context__
    self._failures.append((re.compile(rf"/{step}(?:/|\.orbax-checkpoint-tmp)"), tuple(types)))
    std_logging.getLogger("asyncio").addFilter(self)  # once: a filter already there is not added again

  def filter(self, record: std_logging.LogRecord) -> bool:
    exception = record.exc_info[1] if record.exc_info else None
    if exception is None or "exception was never retrieved" not in str(record.msg):
      return True
    text = str(exception)
    return not any(isinstance(exception, types) and step.search(text) for step, types in self._failures)


_failed_write_tasks = _FailedWriteTasks()


class Saves:
  """Starts saves, and turns a failed one into a CheckpointError naming its step as soon as it is known.

  Orbax raises a failed background save only at the next save or at close, with a traceback; `check`
  (called every step, it never blocks) reports it at the first step after the failure instead."""

  def __init__(self, manager: ocp.CheckpointManager):
    self.manager = manager
    self._unconfirmed: int | None = None  # the last step saved, until its save is known to have succeeded

  def save(self, step: int, state: Any, data_iterator: Any, config: Config, force: bool = True) -> None:
    self.wait()  # a failure of the previous save is reported as that step's, not this one's
    if step in self.manager.all_steps():
      # Only a step that resuming skipped as unreadable can be here; its files are kept for inspection.
      logging.warning(
        "not saving step %d: %s holds an unreadable checkpoint of that step, kept as it is",
        step,
        storage.join(str(self.manager.directory), str(step)),
      )
      return
    self._unconfirmed = step
    try:
      save(self.manager, step, state, data_iterator, config, force)
    except Exception as e:  # a synchronous save, or the copy off the devices, failed
      self._unconfirmed = None
      raise self._failed(step, e) from e

  def check(self) -> None:
    """Raises if the last background save has finished and failed; returns at once otherwise."""
    if self._unconfirmed is not None and not self.manager.is_saving_in_progress():
      self.wait()

  def wait(self) -> None:
    """Waits for the last save to finish; raises if it failed."""
    step, self._unconfirmed = self._unconfirmed, None
    if step is None:
      return
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      raise self._failed(step, e) from e

  def close(self, raise_errors: bool) -> None:
    """Waits for the last save and stops orbax's threads. With `raise_errors` false (the run is already
    stopping with another error, which must stay the one reported) a failed save is logged instead."""
    try:
      self.wait()
    except CheckpointError as e:
      if raise_errors:
        raise
      logging.error("%s", e)
    finally:
      self.manager.close()

  def _failed(self, step: int, error: BaseException) -> CheckpointError:
    _failed_write_tasks.add(step, error)
    where = storage.join(str(self.manager.directory), str(step))
    cause = first_line(error, with_type=True, limit=1000)  # storage errors name the file first, the reason last
    return CheckpointError(f"saving checkpoint step {step} to {where} failed ({cause})")


_READABLE, _UNREADABLE, _FAILED = 0, 1, 2
T = TypeVar("T")


def restore_newest(
  manager: ocp.CheckpointManager, target: Any, data_iterator: Any, check: Callable[[str], None]
) -> tuple[Any, int] | None:
  """(state, step) of the newest step every process can read (see `restore` and `restore_agreed`); None when
  there is no step. `check(step_dir)` runs first on each step tried and raises CheckpointError if it may not be
  resumed."""

  def dir_of(step: int) -> str:
    return storage.join(str(manager.directory), str(step))

  return restore_agreed(
    manager.all_steps(),
    dir_of,
    lambda step: _check_readable(dir_of(step), target, check),
    lambda step: restore(manager, step, target, data_iterator),
    str(manager.directory),
  )


def restore_agreed(
  steps: Sequence[int],
  dir_of: Callable[[int], str],
  check: Callable[[int], None],
  restore_step: Callable[[int], T],
  directory: str,
) -> tuple[T, int] | None:
  """(restore_step(step), step) for the newest of process 0's `steps` that every process can read; None when
  there are no steps. `dir_of(step)` is the step's directory, `directory` theirs, as messages name them.

  Each process runs `check(step)` on its own, so it must use no collectives: it reads what the restore will read
  before its collectives, and raises CheckpointError if the step may not or cannot be resumed. All processes
  then agree before any of them enters `restore_step`, where a process that gave up alone would leave the
  others waiting for it. A step that is definitely unreadable on any process (reads.UnreadableCheckpointError)
  is skipped by all, with a warning on every process, and left on disk as it is, so a corrupt newest step costs
  the steps since the one before, not every restart. Any other failure on any process (a step that does not fit
  this config, storage that kept failing) stops every process: an earlier step would not fit either, or would
  be a wrong resume."""
  skipped: list[str] = []
  for step in agreement.process_0s(sorted(steps, reverse=True)):
    step_dir = dir_of(step)
    error: CheckpointError | None = None
    try:
      check(step)
    except CheckpointError as e:
      error = e
    verdicts = agreement.everyones(
      _READABLE if error is None else _UNREADABLE if isinstance(error, UnreadableCheckpointError) else _FAILED
    )
    if all(v == _READABLE for v in verdicts):
      try:
        return restore_step(step), step
      except UnreadableCheckpointError as e:
        if len(verdicts) > 1:  # the others wait in the restore's collectives: no agreement is possible now
          raise CheckpointError(
            f"{e} on process {jax.process_index()} while restoring it; move {step_dir} aside and start again to "
            "resume every process from the step before"
          ) from e
        error = e
    if _FAILED in verdicts:
      if error is not None and not isinstance(error, UnreadableCheckpointError):
        raise error
      failed = [p for p, v in enumerate(verdicts) if v == _FAILED]
      raise CheckpointError(f"resuming from checkpoint {step_dir} failed on process {failed} (its log says why)")
    unreadable = [p for p, v in enumerate(verdicts) if v == _UNREADABLE]
    where = f" on every process, unreadable on process {unreadable}" if len(verdicts) > 1 else ", unreadable"
    reason = f": {error}" if error is not None else ""
    logging.warning("skipping checkpoint step %d%s%s; trying an earlier step", step, where, reason)
    skipped.append(f"step {step}{': ' + str(error) if error is not None else where}")
  if skipped:
    raise CheckpointError(
      f"no checkpoint in {directory} could be read ({'; '.join(skipped)}); move the step directories "
      "aside to start over, or set load_full_state_path to a good step of another run"
    )
  return None


def _check_readable(step_dir: str, target: Any, check: Callable[[str], None]) -> None:
  """Reads what a restore of the step reads before the arrays (no collectives, so each process can fail
  alone and still take part in the agreement): its config, the state's metadata, the iterator files."""
  read(step_dir, functools.partial(check, step_dir))  # its config file may be what is corrupt
  check_compatible(storage.join(step_dir, STATE), target)
  iterators = epath.Path(storage.join(step_dir, DATA_ITER))
  read(step_dir, lambda: DataIteratorHandler().restore(iterators))


def restore(manager: ocp.CheckpointManager, step: int, target: Any, data_iterator: Any) -> Any:
  """The state of `step` placed as `target` says (shapes, dtypes, current-mesh shardings); also
  moves `data_iterator` to where that step left it."""
  step_dir = storage.join(str(manager.directory), str(step))
  check_compatible(storage.join(step_dir, STATE), target)
  args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target), DATA_ITER: DataIteratorRestore()})
  restored = read(step_dir, lambda: manager.restore(step, args=args))
  try:
    data_iterator.set_state(select_iterator_state(restored[DATA_ITER], step_dir))
  except InputError as e:
    raise CheckpointError(
      f"checkpoint {step_dir}: {e}; resume with the settings it was saved with, or start a new run_name with "
      f"load_full_state_path={step_dir} (keeps model and optimizer, starts a new data stream)"
    ) from None
  return restored[STATE]


def select_iterator_state(saved: dict[int, Any], step_dir: str) -> Any:
  """The data position to continue from, whatever the topology that saved it: every process saved the
  state of the batch rows it held, and their union names every row (synthetic data: a step count, the
  same on every process)."""
  if not saved:
    raise CheckpointError(f"checkpoint {step_dir} has no data iterator state")
  states = [saved[p]["state"] for p in sorted(saved)]
  if "slots" not in states[0]:
    return states[0]
  merged = {k: v for k, v in states[0].items() if k != "slots"} | {"slots": {}}
  for state in states:
    merged["slots"].update(state["slots"])
  return merged


def _key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_name(path: tuple[Any, ...]) -> str:
  return ".".join(_key_name(k) for k in path)


def saved_arrays(state_dir: str) -> dict[str, Any]:
  """{dotted name: array metadata (shape, dtype)} of a saved state item, without reading arrays."""
  tree = read(state_dir, lambda: ocp.PyTreeCheckpointHandler().metadata(epath.Path(state_dir)).tree)
  return {path_name(p): m for p, m in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_compatible(state_dir: str, target: Any) -> None:
  """Names the first parameter whose saved shape differs from (or is missing for) this config, or a saved
  parameter this config lacks (e.g. q/k norms of a checkpoint loaded with use_qk_norm=false)."""
  saved = saved_arrays(state_dir)
  wanted = {path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(target)[0]}
  extra = sorted(n for n in saved if n.startswith("params.") and n not in wanted)
  if extra and any(n.startswith("params.") for n in wanted):
    raise CheckpointError(
      f"checkpoint {state_dir} has '{extra[0]}' which this config's model lacks ({len(extra)} such); "
      "is it from a different model (attention_bias, use_qk_norm, num_experts ...)?"
    )
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


def incomplete_saves(directory: str) -> list[str]:
  """Names of saves a crash cut short: orbax's temporary directories, or gs:// steps without a commit marker."""
  names = storage.listdir(directory)
  finished = {str(s) for s in step_numbers(directory)}
  return sorted(n for n in names if "tmp" in n or (n.isdigit() and n not in finished))


def resolve_state_dir(path: str, key: str) -> str:
  """A load path may name a step directory (…/checkpoints/100) or its state item (…/100/state)."""
  path = storage.absolute(path).rstrip("/")
  try:
    found = storage.isdir(path)
  except Exception as e:  # an unreachable bucket or missing credentials
    raise CheckpointError(f"{key}={path}: cannot read it ({type(e).__name__}: {first_line(e)})") from None
  if not found:
    raise CheckpointError(f"{key}={path}: no such directory{_steps_beside(path)}")
  if storage.isdir(storage.join(path, STATE)):
    if not is_finalized(path):
      raise CheckpointError(f"{key}={path}: this save was never completed (no {COMMIT_MARKER})")
    return storage.join(path, STATE)
  if storage.exists(storage.join(path, "_METADATA")):
    return path
  steps = step_numbers(path)[::-1]
  hint = f" (it holds steps {steps[:5]}; use e.g. {storage.join(path, str(steps[0]))})" if steps else ""
  raise CheckpointError(f"{key}={path} is not a checkpoint step directory{hint}")


def _steps_beside(path: str) -> str:
  """The steps next to a missing step directory: a mistyped or not yet saved step is the usual cause."""
  parent = storage.dirname(path)
  try:
    steps = step_numbers(parent) if storage.isdir(parent) else []
  except Exception:  # an unreadable parent adds nothing to "no such directory"
    return ""
  if not steps:
    return ""
  shown = ", ".join(map(str, steps[-10:])) + (f" ({len(steps)} in all)" if len(steps) > 10 else "")
  return f"; {parent} holds steps {shown} (the newest: {storage.join(parent, str(steps[-1]))})"


def load_params(path: str, target_params: Any) -> Any:
  """Only the params of a checkpoint (a full train state or a params-only export)."""
  state_dir = resolve_state_dir(path, "load_parameters_path")
  target = {"params": target_params}
  check_compatible(state_dir, target)
  args = ocp.args.PyTreeRestore(
    item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
  )
  with ocp.PyTreeCheckpointer() as checkpointer:
    return read(state_dir, lambda: checkpointer.restore(state_dir, args=args))["params"]


def load_full_state(path: str, target: Any) -> Any:
  """The train state saved at `path`, placed as `target`. A DPO target's reference is left None when the step has
  none (a pretraining or SFT run's); the trainer then makes the loaded parameters the reference."""
  state_dir = resolve_state_dir(path, "load_full_state_path")
  if getattr(target, "reference", None) is not None:
    if not any(name.startswith("reference.") for name in saved_arrays(state_dir)):
      target = target.replace(reference=None)
  check_compatible(state_dir, target)
  with ocp.StandardCheckpointer() as checkpointer:
    return read(state_dir, lambda: checkpointer.restore(state_dir, target))


def sharded_target(abstract: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
