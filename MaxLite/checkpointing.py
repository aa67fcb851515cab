"""Orbax checkpoints of the full train state plus the data iterator state, and auto-resume.

Layout: <run_dir>/checkpoints/<step>/{state, data_iter}. Orbax writes each step into a temporary
directory and renames it when complete, so a save interrupted by a crash is never picked up.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from MaxLite.config import Config
from MaxLite.errors import ConfigError


def create_manager(config: Config) -> ocp.CheckpointManager | None:
  if not config.enable_checkpointing:
    return None
  if config.process_count > 1:
    # Each process has its own data iterator position; until those are saved per process a
    # multi-host resume could silently repeat or skip data, so refuse rather than diverge.
    raise ConfigError("enable_checkpointing with several processes is not supported yet (data iterator state "
                      "is saved for one process only); set enable_checkpointing=false")
  options = ocp.CheckpointManagerOptions(
      # The trainer decides when to save (every checkpoint_period steps and the last step).
      max_to_keep=None if config.max_checkpoints_to_keep == -1 else config.max_checkpoints_to_keep,
      enable_async_checkpointing=config.async_checkpointing,
      create=True)
  return ocp.CheckpointManager(os.path.abspath(config.checkpoint_dir), options=options,
                               item_names=("state", "data_iter"))


def save(manager: ocp.CheckpointManager, step: int, state: Any, data_iterator: Any) -> None:
  """Save now (async saves return once the arrays are copied off the devices)."""
  args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                            data_iter=ocp.args.JsonSave(data_iterator.get_state()))
  manager.save(step, args=args, force=True)


def restore_latest(manager: ocp.CheckpointManager, abstract_state: Any, shardings: Any,
                   data_iterator: Any) -> tuple[Any, int] | None:
  """(state placed on the current mesh, step) of the newest complete checkpoint, or None."""
  step = manager.latest_step()
  if step is None:
    return None
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                           data_iter=ocp.args.JsonRestore()))
  data_iterator.set_state(restored.data_iter)
  return restored.state, step
