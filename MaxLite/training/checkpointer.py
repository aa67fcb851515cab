"""When the train loop saves: every checkpoint_period steps (or when the emergency manager asks), at the last step
and at a preemption notice. Never a state holding NaN/Inf, which every restart would reload.

With checkpointing off the loop gets a NoCheckpointer, which restores nothing and never saves.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from MaxLite.checkpoint import manager as checkpointing
from MaxLite.checkpoint.emergency import EmergencyCheckpoints
from MaxLite.checkpoint.resume_checks import check_resume
from MaxLite.config import Config
from MaxLite.parallel import sharding as sharding_lib
from MaxLite.training.metrics import NonFiniteLossError, StepLog
from MaxLite.training.preemption import PreemptionWatcher


def all_finite(tree: Any) -> jax.Array:
  """One boolean: no NaN/Inf in any floating-point leaf."""
  leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves))


class NoCheckpointer:
  """enable_checkpointing=false."""

  def restore_newest(self, target: Any, batches: Any) -> tuple[Any, int] | None:
    del target, batches
    return None

  def check(self) -> None:
    pass

  def maybe_save(self, step: int, state: Any, batches: Any, log: StepLog) -> bool:
    del step, state, batches, log
    return False

  def __enter__(self) -> NoCheckpointer:
    return self

  def __exit__(self, *exc: object) -> None:
    pass


class Checkpointer:
  """Saves in the background with orbax (or the emergency manager); `guard` (the run lock's) is asked before each save
  whether the run still owns its directory."""

  def __init__(self, config: Config, mesh: jax.sharding.Mesh, manager: Any, guard: Any = None):
    self._config, self._mesh, self._manager, self._guard = config, mesh, manager, guard
    self._saves = checkpointing.Saves(manager)
    self._preemption = PreemptionWatcher()
    self._is_finite: Any = None  # jitted at the first save: it waits for the step, which the loop otherwise never does
    logging.info(
      "checkpoints: every %d steps, the last step and on SIGTERM, to %s (enable_checkpointing=false turns them off)",
      config.checkpoint_period,
      config.checkpoint_dir,
    )

  def restore_newest(self, target: Any, batches: Any) -> tuple[Any, int] | None:
    """(state, step) of the run's newest readable checkpoint, or None (auto-resume)."""
    accept = lambda step_dir: check_resume(step_dir, self._config)  # noqa: E731
    if isinstance(self._manager, EmergencyCheckpoints):
      return self._manager.restore_newest(batches, accept)
    return checkpointing.restore_newest(self._manager, target, batches, accept)

  def check(self) -> None:
    """Raises now, naming its step, if a background save has failed; never blocks."""
    self._saves.check()

  def maybe_save(self, step: int, state: Any, batches: Any, log: StepLog) -> bool:
    """Saves `step` if it is due; true when the run must stop here (preempted, after saving)."""
    preempted = self._preemption.reached(step)
    must_save = step == self._config.steps or preempted
    periodic = step % self._config.checkpoint_period == 0 or (
      isinstance(self._manager, EmergencyCheckpoints) and self._manager.wants(step)
    )
    if periodic or must_save:
      log.flush()  # the saved step's metrics row goes out with it (a resume starts after it)
      if self._guard is not None:
        self._guard.before_save(step)
      self._check_finite(step, state, log.rows[-1])
      # Stored before the save starts: a kill the moment the step's files appear must not leave them without its rows
      # (a bucket's metrics.jsonl is rewritten, not appended, so rows not yet stored are lost with the process).
      log.store()
      saved = state if state.frozen is None else state.replace(frozen=None)  # LoRA: the adapters, not the base
      self._saves.save(step, saved, batches, self._config, force=must_save)
    if preempted and self._preemption.interrupted:
      print(
        f"interrupted: saved a checkpoint at step {step} in {self._config.checkpoint_dir}; "
        f"{resume_hint(self._config)} to resume",
        file=sys.stderr,
        flush=True,
      )
    elif preempted:
      logging.info("preempted: saved a checkpoint at step %d, stopping", step)
    return preempted

  def _check_finite(self, step: int, state: Any, row: dict[str, Any]) -> None:
    saved = (state.params, state.opt_state)
    if self._is_finite is None:
      shardings = jax.tree.map(lambda x: x.sharding, saved)
      self._is_finite = jax.jit(
        lambda tree: all_finite(sharding_lib.on_device(tree, shardings)),
        out_shardings=sharding_lib.replicated(self._mesh),
      )
    if not bool(jax.device_get(self._is_finite(saved))):
      raise NonFiniteLossError(
        f"step {step}: its update left NaN/Inf in the parameters or optimizer state (loss {row['loss']}, "
        f"grad_norm {row['grad_norm']}); stopping without saving it (try a lower learning_rate or "
        "gradient_clipping_threshold)"
      )

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, exc_type: Any, *exc: object) -> None:
    """Waits for the last save. If the run is already failing, that error stays the one reported."""
    self._preemption.close()
    self._saves.close(raise_errors=exc_type is None)


def resume_hint(config: Config) -> str:
  """How to resume this run: the same command, which names the run only when run_name was given (else it would
  start a new run with a new timestamped name)."""
  if "run_name" in getattr(config, "explicit_keys", ("run_name",)):
    return "run the same command"
  return f"run the same command with run_name={config.run_name}"


def make_checkpointer(config: Config, mesh: jax.sharding.Mesh, pieces: Any, guard: Any = None) -> Any:
  """The run's Checkpointer (orbax or emergency), or a NoCheckpointer when checkpointing is off. `pieces` is
  builder.training's."""
  if config.enable_emergency_checkpoint:
    target = checkpointing.sharded_target(pieces.abstract, pieces.device_shardings)
    manager = EmergencyCheckpoints(config, mesh, target)
  else:
    manager = checkpointing.create_manager(config)
  return NoCheckpointer() if manager is None else Checkpointer(config, mesh, manager, guard)
