"""Eval loss during training: every eval_interval steps, the mean loss per real token over eval_steps batches.

With eval off (eval_interval=0, or no eval files) the loop gets a NoEvaluator, which never evaluates.
"""

from __future__ import annotations

from typing import Any

import jax

from MaxLite.config import Config
from MaxLite.data import input_pipeline
from MaxLite.layers.decoder import Transformer
from MaxLite.parallel import sharding as sharding_lib
from MaxLite.training.metrics import StepLog
from MaxLite.training.train_step import jit_eval_step


def evaluate(config: Config, mesh: jax.sharding.Mesh, eval_fn: Any, params: Any, batches: Any = None) -> float:
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


class NoEvaluator:
  def maybe_eval(self, step: int, params: Any, log: StepLog) -> None:
    del step, params, log

  def __enter__(self) -> NoEvaluator:
    return self

  def __exit__(self, *exc: object) -> None:
    pass


class Evaluator:
  """The jitted eval step and the run's eval iterator, made once and rewound for every eval."""

  def __init__(self, config: Config, mesh: jax.sharding.Mesh, param_shardings: Any, batch_sharding: Any):
    self._config, self._mesh = config, mesh
    self._eval_fn = jit_eval_step(
      config, Transformer(config).apply, param_shardings, batch_sharding, sharding_lib.replicated(mesh)
    )
    self._batches = input_pipeline.make_iterator(config, mesh, "eval")

  def maybe_eval(self, step: int, params: Any, log: StepLog) -> None:
    if step % self._config.eval_interval != 0:
      return
    log.flush()  # the step's own row comes before its eval row
    log.record_eval(step, evaluate(self._config, self._mesh, self._eval_fn, params, self._batches))

  def __enter__(self) -> Evaluator:
    return self

  def __exit__(self, *exc: object) -> None:
    self._batches.close()


def make_evaluator(config: Config, mesh: jax.sharding.Mesh, param_shardings: Any, batch_sharding: Any) -> Any:
  if config.eval_interval > 0 and (config.dataset_type == "synthetic" or config.grain_eval_files):
    return Evaluator(config, mesh, param_shardings, batch_sharding)
  return NoEvaluator()
