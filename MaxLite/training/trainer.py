"""The training loop: config -> mesh -> state -> input -> jitted step, with checkpoints, eval, metrics and the
profiler as components that each decide for themselves when to act.

The host never waits on the device for the step it just dispatched: metrics of step N are read after step N+1 has
been queued, so logging costs no device idle time. A save step is the exception: before step N is saved its metrics
are read and its new state is checked for NaN/Inf.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
from absl import logging
from flax.linen import partitioning as nn_partitioning

from MaxLite import storage
from MaxLite.checkpoint import lora_steps
from MaxLite.checkpoint import manager as checkpointing
from MaxLite.cli import ticker
from MaxLite.config import Config, objectives
from MaxLite.data import input_pipeline
from MaxLite.parallel import sharding as sharding_lib
from MaxLite.parallel.mesh import create_mesh, describe_mesh
from MaxLite.training import builder, ensemble, grpo_run, lora_training
from MaxLite.training.checkpointer import NoCheckpointer, make_checkpointer, resume_hint
from MaxLite.training.evaluation import NoEvaluator, make_evaluator
from MaxLite.training.metrics import StepLog
from MaxLite.training.profiler import Profiler
from MaxLite.training.train_state import (
  bytes_per_device,
  create_train_state,
  keeps_reference,
  reference_from_params,
  state_from_params,
)


def train(
  config: Config,
  devices: Sequence[jax.Device] | None = None,
  guard: Any = None,
  lock: Callable[[Config], contextlib.AbstractContextManager[Any]] | None = None,
) -> list[dict[str, Any]]:
  """Train for config.steps steps; returns the metrics rows (also written to metrics.jsonl). `guard`
  (run_lock.hold's, on every process) is asked before each save and each metrics row whether the run still owns its
  directory; or `lock` (run_lock.hold) is taken once the inputs are checked, and its guard asked."""
  mesh = create_mesh(config, devices)
  logging.info(describe_mesh(mesh))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    return _train_on_mesh(config, mesh, guard, lock)


def initial_state(
  config: Config, pieces: builder.Training, checkpointer: Any = None, batches: Any = None
) -> tuple[Any, int]:
  """(state, step): the run's own latest checkpoint if any (auto-resume), else load_full_state_path, else a fresh
  init (with load_parameters_path's params if set)."""
  model, tx, shardings = pieces.model, pieces.tx, pieces.shardings
  target = checkpointing.sharded_target(pieces.abstract, shardings)
  if config.enable_lora:
    return lora_training.initial_state(config, pieces, target, checkpointer or NoCheckpointer(), batches)
  resumed = (checkpointer or NoCheckpointer()).restore_newest(target, batches)
  if resumed is not None:
    state, step = resumed
    logging.info("resumed from checkpoint at step %d in %s", step, config.checkpoint_dir)
    return state, step
  if config.load_full_state_path:
    state = checkpointing.load_full_state(config.load_full_state_path, target)
    if keeps_reference(config) and state.reference is None:
      state = reference_from_params(state, shardings)
      logging.info("the loaded state has no reference: its parameters are the frozen reference")
    logging.info("loaded full state at step %d from %s", int(state.step), config.load_full_state_path)
    return state, int(state.step)
  if config.load_parameters_path:
    if config.ensemble_size > 1:  # every member starts from these parameters
      one = ensemble.one_member_target(target.params)
      params = lora_steps.load_params(config.load_parameters_path, one, config.ensemble_member)
      logging.info("loaded parameters from %s into every member (step 0)", config.load_parameters_path)
      return ensemble.state_from_params(model, tx, config, params, shardings, pieces.abstract), 0
    params = lora_steps.load_params(config.load_parameters_path, target.params, config.ensemble_member)
    logging.info("loaded parameters from %s (fresh optimizer, step 0)", config.load_parameters_path)
    return state_from_params(model, tx, config, params, shardings), 0
  if config.ensemble_size > 1:  # every member from its own seed
    return ensemble.create_state(model, tx, config, shardings, pieces.abstract), 0
  return create_train_state(model, tx, config, shardings), 0


def _log_memory(config: Config, state: Any) -> None:
  params_mib = bytes_per_device(state.params) / 2**20
  offloaded = config.parameter_memory_host_offload or config.optimizer_memory_host_offload
  # Gradients are created inside the step with the parameters' shardings and dtype.
  logging.info(
    "memory per device: params %.1f MiB, gradients %.1f MiB, optimizer state %.1f MiB%s",
    params_mib,
    params_mib,
    bytes_per_device(state.opt_state) / 2**20,
    " (params and/or optimizer state kept in host memory between steps)" if offloaded else "",
  )


def _print_sharding_report(pieces: builder.Training) -> None:
  params = pieces.abstract.params
  print(sharding_lib.sharding_report(params, pieces.logical.params, pieces.device_shardings.params), flush=True)


def _train_on_mesh(config: Config, mesh: jax.sharding.Mesh, guard: Any, lock: Any) -> list[dict[str, Any]]:
  input_pipeline.check_tokenizer(config)
  pieces = builder.training(config, mesh)
  if config.debug_sharding and jax.process_index() == 0:
    _print_sharding_report(pieces)
  with contextlib.ExitStack() as stack:  # closed in reverse: the last save is waited for before the input stops
    # GRPO samples its batches from prompts with the policy itself; `batches` is then the prompt stream.
    rl = grpo_run.GrpoSteps(config, mesh, pieces) if objectives.of(config).rollouts else None
    batches = rl.batches if rl else input_pipeline.make_iterator(config, mesh, "train")
    stack.enter_context(contextlib.closing(batches))
    # The lock makes the run directory: only now that the tokenizer and data files have been checked, so a run
    # that fails those checks leaves nothing behind. Released after the last save (the stack closes in reverse).
    if lock is not None:
      guard = stack.enter_context(lock(config))
    checkpointer = stack.enter_context(make_checkpointer(config, mesh, pieces, guard))
    state, start_step = initial_state(config, pieces, checkpointer, batches)
    _log_memory(config, state)
    if start_step >= config.steps:
      _say(_nothing_to_do(config, start_step))
      return []
    if rl:
      evaluator = stack.enter_context(grpo_run.make_evaluator(config, mesh, pieces) or NoEvaluator())
    else:
      evaluator = stack.enter_context(make_evaluator(config, mesh, pieces.shardings, pieces.batch_sharding))
    log = stack.enter_context(StepLog(config, guard, resumed_at=start_step))
    if rl and start_step == 0:
      evaluator.maybe_eval(0, state, log)  # where GRPO starts from: the rewards it is to raise
    profiler = stack.enter_context(Profiler(config))
    step = start_step
    for step in range(start_step + 1, config.steps + 1):
      profiler.before_step(step, state)
      # The first call compiles the step (silent for tens of seconds, minutes for a large model): say so.
      with ticker.ticking("compiling the train step", enabled=step == start_step + 1 and jax.process_index() == 0):
        state, metrics = rl(state, step) if rl else pieces.step(state, next(batches))
      checkpointer.check()  # a background save that failed stops the run now, naming its step
      log.record(step, metrics)
      if checkpointer.maybe_save(step, state, batches, log):
        break  # preempted, and saved
      evaluator.maybe_eval(step, state, log)
    profiler.stop(state)  # a trace that runs to the last step holds all of it
    log.flush()
  _say(_done(config, step, log.rows))  # after the stack: the last save is complete
  return log.rows


def _say(line: str) -> None:
  """A run's closing line, once per job: the last thing a user reads, so on stdout after the log."""
  if jax.process_index() == 0:
    print(line, flush=True)


def _nothing_to_do(config: Config, step: int) -> str:
  where = config.checkpoint_dir
  # initial_state resumes the run's own checkpoint first; a step that is not there came from load_full_state_path.
  if config.load_full_state_path and not storage.exists(storage.join(config.checkpoint_dir, str(step))):
    where = config.load_full_state_path
  return f"nothing to do: step {step} of {config.steps} already saved in {where} (raise steps to train further)"


def _done(config: Config, step: int, rows: list[dict[str, Any]]) -> str:
  stopped = "" if step == config.steps else f" of {config.steps} (stopped early; {resume_hint(config)} to continue)"
  saved = (
    f"saved to {storage.join(config.checkpoint_dir, str(step))}"
    if config.enable_checkpointing  # the last step and a preempted one are always saved
    else "not saved (enable_checkpointing=false)"
  )
  evals = [row for row in rows if "eval_loss" in row]
  eval_loss = f", eval loss {evals[-1]['eval_loss']:.4f} at step {evals[-1]['step']}" if evals else ""
  best = ensemble.best_member(config, rows) if config.ensemble_size > 1 else ""
  return f"done: step {step}{stopped}, {saved}{eval_loss}{best}, metrics in {config.metrics_file}"
