"""The training loop: wires config -> mesh -> state -> input -> jitted step -> metrics.

The host never waits on the device for the step it just dispatched: metrics of step N are
fetched after step N+1 has been queued, so logging costs no device idle time. A save step is the
exception: before step N is saved its metrics are read and its new state is checked for NaN/Inf, so
a broken state is never checkpointed (every restart would reload it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax.linen import partitioning as nn_partitioning

from MaxLite.checkpoint import manager as checkpointing
from MaxLite.checkpoint.emergency import EmergencyCheckpoints
from MaxLite.checkpoint.resume_checks import check_resume
from MaxLite.cli.errors import MaxLiteError
from MaxLite.config import Config
from MaxLite.data import input_pipeline
from MaxLite.layers.decoder import Transformer
from MaxLite.parallel import sharding as sharding_lib
from MaxLite.parallel.mesh import create_mesh, describe_mesh
from MaxLite.training import flops
from MaxLite.training.metrics import MetricsWriter, log_line
from MaxLite.training.optimizer import create_optimizer
from MaxLite.training.preemption import PreemptionWatcher
from MaxLite.training.train_state import abstract_state, bytes_per_device, create_train_state, state_from_params
from MaxLite.training.train_step import jit_eval_step, jit_train_step


class NonFiniteLossError(MaxLiteError):
  """Loss or gradient norm became NaN/Inf."""


class _Profiler:
  """jax.profiler trace of steps [first, first + count) into the tensorboard dir, when enabled."""

  def __init__(self, config: Config):
    self._on = config.profiler == "xplane" and jax.process_index() == 0
    self._first, self._last = (
      config.skip_first_n_steps_for_profiler,
      (config.skip_first_n_steps_for_profiler + config.profiler_steps),
    )
    self._dir, self._active = config.tensorboard_dir, False

  def before_step(self, step: int) -> None:
    if self._on and step == self._first:
      jax.profiler.start_trace(self._dir)
      self._active = True
    if self._active and step == self._last:
      self.stop()

  def stop(self) -> None:
    if self._active:
      jax.profiler.stop_trace()
      self._active = False


def _all_finite(tree: Any) -> jax.Array:
  """One boolean: no NaN/Inf in any floating-point leaf."""
  leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves))


def evaluate(config: Config, mesh, eval_fn, params, batches: Any = None) -> float:
  """Mean loss per real token over the first eval_steps eval batches. `batches`, the run's eval iterator,
  is rewound and reused; without it a new one is made and closed."""
  totals = {"xent_sum": 0.0, "z_sum": 0.0, "tokens": 0.0}
  own = batches is None
  if own:
    batches = input_pipeline.make_iterator(config, mesh, "eval")
  else:
    batches.rewind()
  try:
    for _ in range(config.eval_steps):
      aux = jax.device_get(eval_fn(params, next(batches)))
      for k in totals:
        totals[k] += float(aux[k])
  finally:
    if own:
      batches.close()
  return totals["xent_sum"] / max(totals["tokens"], 1.0)


def train(config: Config, devices: Sequence[jax.Device] | None = None, guard: Any = None) -> list[dict[str, Any]]:
  """Train for config.steps steps; returns the metrics rows (also written to metrics.jsonl). `guard`
  (run_lock.hold's, on every process) is asked before each save whether the run still owns its directory."""
  mesh = create_mesh(config, devices)
  logging.info(describe_mesh(mesh))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    return _train_on_mesh(config, mesh, guard)


def initial_state(config: Config, mesh, model, tx, manager, batches) -> tuple[Any, Any, int]:
  """(state, its shardings, step): the run's own latest checkpoint if any (auto-resume), else
  load_full_state_path, else a fresh init (with load_parameters_path's params if set)."""
  abstract, _, shardings = abstract_state(model, tx, config, mesh)
  shardings = sharding_lib.with_host_offload(shardings, config)
  target = checkpointing.sharded_target(abstract, shardings)
  resumed = None
  if isinstance(manager, EmergencyCheckpoints):
    resumed = manager.restore_newest(batches, lambda step_dir: check_resume(step_dir, config))
  elif manager is not None:
    resumed = checkpointing.restore_newest(manager, target, batches, lambda step_dir: check_resume(step_dir, config))
  if resumed is not None:
    state, step = resumed
    logging.info("resumed from checkpoint at step %d in %s", step, config.checkpoint_dir)
    return state, shardings, step
  if config.load_full_state_path:
    state = checkpointing.load_full_state(config.load_full_state_path, target)
    logging.info("loaded full state at step %d from %s", int(state.step), config.load_full_state_path)
    return state, shardings, int(state.step)
  if config.load_parameters_path:
    params = checkpointing.load_params(config.load_parameters_path, target.params)
    logging.info("loaded parameters from %s (fresh optimizer, step 0)", config.load_parameters_path)
    return state_from_params(model, tx, params, shardings), shardings, 0
  return create_train_state(model, tx, config, shardings), shardings, 0


def _offloaded(config: Config) -> bool:
  return config.parameter_memory_host_offload or config.optimizer_memory_host_offload


def _train_on_mesh(config: Config, mesh, guard: Any) -> list[dict[str, Any]]:
  input_pipeline.check_tokenizer(config)
  model = Transformer(config, deterministic=config.dropout_rate == 0.0)
  tx = create_optimizer(config)
  if config.debug_sharding and jax.process_index() == 0:
    abstract, logical, shardings = abstract_state(model, tx, config, mesh)
    print(sharding_lib.sharding_report(abstract.params, logical.params, shardings.params), flush=True)
  if config.enable_emergency_checkpoint:
    abstract, _, shardings = abstract_state(model, tx, config, mesh)
    manager = EmergencyCheckpoints(config, mesh, checkpointing.sharded_target(abstract, shardings))
  else:
    manager = checkpointing.create_manager(config)
  batches = input_pipeline.make_iterator(config, mesh, "train")
  try:
    state, state_shardings, start_step = initial_state(config, mesh, model, tx, manager, batches)
  except BaseException:
    batches.close()
    if manager is not None:
      manager.close()
    raise
  params_bytes = bytes_per_device(state.params)
  # Gradients are created inside the step with the parameters' shardings and dtype.
  logging.info(
    "memory per device: params %.1f MiB, gradients %.1f MiB, optimizer state %.1f MiB"
    + (" (params and/or optimizer state kept in host memory between steps)" if _offloaded(config) else ""),
    params_bytes / 2**20,
    params_bytes / 2**20,
    bytes_per_device(state.opt_state) / 2**20,
  )
  batch_sharding, replicated = sharding_lib.batch_sharding(mesh, config), sharding_lib.replicated(mesh)
  step_fn = jit_train_step(config, state_shardings, batch_sharding, replicated)
  # Run on save steps only: it waits for the step, which the loop otherwise never does.
  state_is_finite = jax.jit(
    lambda s: _all_finite(
      sharding_lib.on_device((s.params, s.opt_state), (state_shardings.params, state_shardings.opt_state))
    ),
    out_shardings=replicated,
  )
  eval_fn = eval_batches = None
  if config.eval_interval > 0 and (config.dataset_type == "synthetic" or config.grain_eval_files):
    eval_fn = jit_eval_step(config, Transformer(config).apply, state_shardings.params, batch_sharding, replicated)
    eval_batches = input_pipeline.make_iterator(config, mesh, "eval")

  writer = MetricsWriter(config, is_primary=jax.process_index() == 0)
  profiler = _Profiler(config)
  tflops_per_device = flops.tflops_per_device_per_step(config)
  tokens_per_step = config.global_batch_size_to_train_on * config.max_target_length
  rows: list[dict[str, Any]] = []
  pending = None
  last_time = time.perf_counter()

  def finish(step: int, metrics: Any) -> None:
    nonlocal last_time
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    now = time.perf_counter()
    step_time, last_time = now - last_time, now
    if not (np.isfinite(values["loss"]) and np.isfinite(values["grad_norm"])):
      raise NonFiniteLossError(
        f"step {step}: loss is {values['loss']} and grad_norm is {values['grad_norm']}; "
        "stopping (try a lower learning_rate or gradient_clipping_threshold)"
      )
    row = {
      "step": step,
      "loss": values["loss"],
      "learning_rate": values["learning_rate"],
      "grad_norm": values["grad_norm"],
      "step_time_s": step_time,
      "tokens_per_s": tokens_per_step / step_time,
      "tflops_per_device": tflops_per_device / step_time,
    }
    if config.z_loss_multiplier:
      row["z_loss"] = values["z_loss"]
    for key in ("moe_lb_loss", "moe_dropped_fraction"):
      if key in values:
        row[key] = values[key]
    if config.peak_tflops_per_device > 0:
      row["mfu"] = row["tflops_per_device"] / config.peak_tflops_per_device
    if step % config.log_period == 0 or step == config.steps:
      logging.info(log_line(row))
      writer.write(row)
    rows.append(row)

  def check_state(step: int) -> None:
    if not bool(jax.device_get(state_is_finite(state))):
      row = rows[-1]
      raise NonFiniteLossError(
        f"step {step}: its update left NaN/Inf in the parameters or optimizer state (loss {row['loss']}, "
        f"grad_norm {row['grad_norm']}); stopping without saving it (try a lower learning_rate or "
        "gradient_clipping_threshold)"
      )

  if manager is not None:
    logging.info(
      "checkpoints: every %d steps, the last step and on SIGTERM, to %s (enable_checkpointing=false turns them off)",
      config.checkpoint_period,
      config.checkpoint_dir,
    )
  preemption = PreemptionWatcher() if manager is not None else None
  saves = checkpointing.Saves(manager) if manager is not None else None
  completed = False
  try:
    for step in range(start_step + 1, config.steps + 1):
      profiler.before_step(step)
      state, metrics = step_fn(state, next(batches))
      if saves is not None:
        saves.check()  # a background save that failed stops the run now, naming its step
      if pending is not None:
        finish(*pending)
      pending = (step, metrics)
      preempted = preemption is not None and preemption.reached(step)
      must_save = step == config.steps or preempted
      periodic = step % config.checkpoint_period == 0 or (
        isinstance(manager, EmergencyCheckpoints) and manager.wants(step)
      )
      if saves is not None and (periodic or must_save):
        finish(*pending)  # the saved step's metrics row goes out with it (a resume starts after it)
        pending = None
        if guard is not None:
          guard.before_save(step)
        check_state(step)
        saves.save(step, state, batches, config, force=must_save)
        writer.flush()
      if preempted:
        logging.info("preempted: saved a checkpoint at step %d, stopping", step)
        break
      if eval_fn is not None and step % config.eval_interval == 0:
        if pending is not None:
          finish(*pending)
          pending = None
        eval_loss = evaluate(config, mesh, eval_fn, state.params, eval_batches)
        logging.info(f"step {step:>6d} | eval_loss {eval_loss:.4f}")
        writer.write({"step": step, "eval_loss": eval_loss})
        rows.append({"step": step, "eval_loss": eval_loss})
        last_time = time.perf_counter()
    if pending is not None:
      finish(*pending)
    if saves is not None:
      saves.wait()
    completed = True
  finally:
    if preemption is not None:
      preemption.close()
    if saves is not None:
      saves.close(raise_errors=completed)
    profiler.stop()
    writer.close()
    batches.close()
    if eval_batches is not None:
      eval_batches.close()
  return rows
