"""Emergency checkpoints (MaxText's `enable_emergency_checkpoint`): frequent saves of the train state to each
host's own disk, rare ones to the run's persistent checkpoint directory, through orbax's emergency checkpoint
manager (orbax.checkpoint.experimental.emergency).

Orbax splits the hosts by the mesh's data axis into replicas of the state: the first replica saves to persistent
storage every `checkpoint_period` steps, the others to their `local_checkpoint_directory` every
`local_checkpoint_period` steps. A restart restores the newest step any replica has (a replica that holds it
reads it and sends it to the others) or else the newest persistent one. A host that lost its disk has no local
steps, and the job resumes from what the others have. Before orbax's collective restore every process reads the
step's data positions and config, and all agree on the outcome (checkpoint/manager.py `restore_agreed`): a step
that some process finds unreadable is skipped by all, any other failure stops all, none is left waiting.

Orbax's manager holds the state only. The data positions of every process (what resumes the input stream
exactly) and the config go to `<run_dir>/data_positions/<step>` on persistent storage at every save, local or
persistent, so every restorable step has them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency_manager

from MaxLite import storage
from MaxLite.checkpoint import CONFIG, DATA_ITER
from MaxLite.checkpoint.manager import (
  ConfigHandler,
  ConfigSave,
  DataIteratorHandler,
  DataIteratorSave,
  restore_agreed,
  select_iterator_state,
)
from MaxLite.checkpoint.reads import read
from MaxLite.cli.errors import CheckpointError, InputError
from MaxLite.config import Config
from MaxLite.config.choices import MESH_AXES
from MaxLite.storage.layout import DATA_POSITIONS


def local_directory(config: Config) -> str:
  """This process's local checkpoint directory: one per run and process, so hosts (or processes sharing a
  machine) never read each other's files as their own."""
  root = storage.absolute(config.local_checkpoint_directory)
  return storage.join(root, config.run_name, f"process_{jax.process_index()}")


def _step_numbers(folder: str) -> list[int]:
  """Finished steps in a local directory (orbax names a step's folder by its number once it is complete)."""
  return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []


def _no_mesh() -> Any:
  """Orbax's emergency manager makes small arrays with jnp and gathers them across processes; under the run's
  mesh (jax.set_mesh) those would be global arrays, which its gathers refuse."""
  return jax.set_mesh(None)


class EmergencyCheckpoints:
  """The orbax emergency manager for the state, and a plain one for data positions and config."""

  def __init__(self, config: Config, mesh: jax.sharding.Mesh, target: Any):
    self.config = config
    self.directory = storage.absolute(config.checkpoint_dir)
    local = local_directory(config)
    storage.makedirs(local)  # orbax wants both directories to exist; on gs:// a folder exists once it holds an object
    storage.makedirs(self.directory)
    if storage.is_url(self.directory) and not storage.exists(self.directory):
      storage.write_text(storage.join(self.directory, "EMERGENCY_CHECKPOINTS"), "saved by orbax's emergency manager\n")
    options = emergency_manager.CheckpointManagerOptions(
      local=emergency_manager.LocalCheckpointOptions(save_interval_steps=config.local_checkpoint_period),
      persistent=emergency_manager.PersistentCheckpointOptions(
        save_interval_steps=config.checkpoint_period,
        max_to_keep=None if config.max_num_checkpoints_to_keep == -1 else config.max_num_checkpoints_to_keep,
      ),
      replica_axis_index=MESH_AXES.index("data"),
      enable_async_checkpointing=config.async_checkpointing,
    )
    if jax.process_count() > 1:  # the process <-> device maps orbax's emergency manager reads (as MaxText does)
      if not ocp.multihost.is_runtime_to_distributed_ids_initialized():
        ocp.multihost.initialize_runtime_to_distributed_ids()
      if not ocp.multihost.is_distributed_to_device_ids_initialized():
        ocp.multihost.initialize_distributed_to_device_ids()
    with _no_mesh():
      self._state = emergency_manager.CheckpointManager(local, self.directory, mesh, target, options=options)
    self._data = ocp.CheckpointManager(
      storage.join(storage.absolute(config.run_dir), DATA_POSITIONS),
      options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True),
      item_handlers={DATA_ITER: DataIteratorHandler(), CONFIG: ConfigHandler()},
    )
    logging.info(
      "emergency checkpoints: every %d steps to %s (this process), every %d steps to %s",
      config.local_checkpoint_period,
      local,
      config.checkpoint_period,
      self.directory,
    )

  def wants(self, step: int) -> bool:
    return step % self.config.local_checkpoint_period == 0 or step % self.config.checkpoint_period == 0

  def all_steps(self) -> list[int]:
    with _no_mesh():
      return sorted(set(self._state.all_steps()) & set(self._data.all_steps()))

  def save(self, step: int, state: Any, data_iterator: Any, config: Config, force: bool) -> None:
    """Saves `step` on the tiers whose period it is (both when `force`: the last step, a preemption). The data
    positions go first, so a state step cut short by a kill is never found without them."""
    with _no_mesh():
      if not (force or self._state.should_save(step)):
        return
    if step not in self._data.all_steps():  # else a killed run wrote them before its state: the same positions
      data = {DATA_ITER: DataIteratorSave(data_iterator.get_state()), CONFIG: ConfigSave(config.to_dict())}
      self._data.save(step, args=ocp.args.Composite(**data), force=True)
    with _no_mesh():
      self._state.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)), force=force)

  def restore_newest(self, data_iterator: Any, check: Callable[[str], None]) -> tuple[Any, int] | None:
    """(state, step) of the newest step some replica or the persistent directory holds and every process can
    read, the same on every process; None when there is none. `check(step_dir)` compares the config the step was
    saved with. A step whose data positions a process cannot read is skipped by all (see `restore_agreed`)."""
    with _no_mesh():
      state_steps, data_steps = sorted(self._state.all_steps()), sorted(self._data.all_steps())
    logging.info("emergency checkpoints: state steps %s, data position steps %s", state_steps, data_steps)
    positions_root = self._data.directory.as_posix()

    def positions_dir(step: int) -> str:
      return storage.join(positions_root, str(step))

    def check_step(step: int) -> None:
      # All this process reads happens here, before the collective restore, so that its failure is agreed on.
      # The data iterator takes the positions of each step tried; the last one is the step restored.
      where = positions_dir(step)
      read(where, lambda: check(where))  # its config file may be what is corrupt
      saved = read(where, lambda: DataIteratorHandler().restore(epath.Path(storage.join(where, DATA_ITER))))
      try:
        data_iterator.set_state(select_iterator_state(saved, where))
      except InputError as e:
        raise CheckpointError(
          f"checkpoint {where}: {e}; resume with the settings it was saved with, or start a new run_name"
        ) from None

    def restore_step(step: int) -> Any:
      self._drop_local_steps_after(step)
      logging.info("emergency checkpoints: restoring step %d", step)
      with _no_mesh():
        return read(f"emergency checkpoint step {step}", lambda: self._state.restore(step)).state

    steps = sorted(set(state_steps) & set(data_steps))
    resumed = restore_agreed(steps, positions_dir, check_step, restore_step, positions_root)
    if resumed is None:
      self._drop_local_steps_after(None)
    return resumed

  def _drop_local_steps_after(self, step: int | None) -> None:
    """Deletes this process's local steps newer than `step`, the one every process resumes from (None: all).

    A kill can leave such a step on one replica only (its data positions or its peers' shards never written); a
    step every process skipped as unreadable goes too (its data positions, and a persistent copy if any, stay as
    they are). The resumed run saves that step number again, and orbax refuses to save over a step it finds on
    disk."""
    local = local_directory(self.config)
    stale = [s for s in _step_numbers(local) if step is None or s > step]
    for s in stale:
      logging.warning("emergency checkpoints: deleting local step %d, newer than the step resumed from (%s)", s, step)
      shutil.rmtree(os.path.join(local, str(s)))
    with _no_mesh():
      self._state.reload()
      self._state.all_steps()  # collective: every process refreshes orbax's cached newest local step

  def is_saving_in_progress(self) -> bool:
    # Orbax's emergency manager cannot be asked; saying "yes" leaves a failed save to be reported at the next
    # save or at the end (Saves.wait), instead of blocking every step until the last save is done.
    return True

  def wait_until_finished(self) -> None:
    with _no_mesh():
      self._state.wait_until_finished()
    self._data.wait_until_finished()

  def close(self) -> None:
    try:
      with _no_mesh():
        self._state.close()
    finally:
      self._data.close()
