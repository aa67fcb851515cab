"""Eval loss during training: every eval_interval steps, the mean loss per real token over eval_steps batches
(DPO: the mean loss and rewards per preference pair).

With eval off (eval_interval=0, or no eval files) the loop gets a NoEvaluator, which never evaluates.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from MaxLite.cli import ticker
from MaxLite.config import Config, objectives
from MaxLite.data import input_pipeline
from MaxLite.models import build
from MaxLite.parallel import sharding as sharding_lib
from MaxLite.training import ensemble
from MaxLite.training.metrics import StepLog
from MaxLite.training.train_state import model_params
from MaxLite.training.train_step import jit_eval_step


def eval_metrics(totals: dict[str, Any], config: Config) -> dict[str, float]:
  """The logged eval metrics from the sums over every eval batch: the objective's (cross-entropy per token without
  z-loss, DPO's loss and TRL's rewards per pair, ...), or an ensemble's (each member's and the ensemble's)."""
  if "ensemble_xent_sum" in totals:
    return ensemble.eval_metrics(totals)
  return objectives.of(config).eval_metrics(totals, config)


def evaluate(
  config: Config, mesh: jax.sharding.Mesh, eval_fn: Any, params: Any, batches: Any = None, reference: Any = None
) -> dict[str, float]:
  """eval_metrics over the first eval_steps eval batches. `batches`, the run's eval iterator, is rewound and reused;
  without it a new one is made and closed. `reference`: the frozen reference parameters (DPO's)."""
  totals: dict[str, Any] = {}  # float sums; an ensemble's per-member sums are arrays
  own = batches is None
  if own:
    batches = input_pipeline.make_iterator(config, mesh, "eval")
  else:
    batches.rewind()
  try:
    for _ in range(config.eval_steps):
      args = (params, next(batches)) + ((reference,) if objectives.of(config).reads_reference else ())
      for k, v in jax.device_get(eval_fn(*args)).items():
        totals[k] = totals.get(k, 0.0) + np.asarray(v, np.float64)  # an ensemble sums one value per member
  finally:
    if own:
      batches.close()
  return {k: float(v) for k, v in eval_metrics(totals, config).items()}


class NoEvaluator:
  def maybe_eval(self, step: int, state: Any, log: StepLog) -> None:
    del step, state, log

  def __enter__(self) -> NoEvaluator:
    return self

  def __exit__(self, *exc: object) -> None:
    pass


def eval_due(config: Config, step: int) -> bool:
  """Every eval_interval steps and at the last step, so a run ends with its own model's eval figures."""
  return step % config.eval_interval == 0 or step == config.steps


class Evaluator:
  """The jitted eval step and the run's eval iterator, made once and rewound for every eval."""

  def __init__(self, config: Config, mesh: jax.sharding.Mesh, state_shardings: Any, batch_sharding: Any):
    self._config, self._mesh = config, mesh
    reference = state_shardings.frozen if config.enable_lora else None  # LoRA: DPO's reference is the base
    jit = ensemble.jit_eval_step if config.ensemble_size > 1 else jit_eval_step
    self._eval_fn = jit(
      config,
      build.model(config).apply,
      model_params(state_shardings),
      batch_sharding,
      sharding_lib.replicated(mesh),
      *([] if config.ensemble_size > 1 else [reference]),
    )
    self._batches = input_pipeline.make_iterator(config, mesh, "eval")
    self._compiled = False

  def maybe_eval(self, step: int, state: Any, log: StepLog) -> None:
    if not eval_due(self._config, step):
      return
    log.flush()  # the step's own row comes before its eval row
    reference = state.frozen if state.frozen is not None else state.reference
    first = not self._compiled
    with ticker.ticking("compiling the eval step", enabled=first and jax.process_index() == 0):
      metrics = evaluate(self._config, self._mesh, self._eval_fn, model_params(state), self._batches, reference)
    self._compiled = True
    log.record_eval(step, metrics)

  def __enter__(self) -> Evaluator:
    return self

  def __exit__(self, *exc: object) -> None:
    self._batches.close()


def make_evaluator(config: Config, mesh: jax.sharding.Mesh, state_shardings: Any, batch_sharding: Any) -> Any:
  """`state_shardings`: the train state's (its parameters', and with LoRA its frozen base's)."""
  if config.eval_interval > 0 and (config.dataset_type == "synthetic" or config.grain_eval_files):
    return Evaluator(config, mesh, state_shardings, batch_sharding)
  return NoEvaluator()
