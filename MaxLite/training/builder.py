"""A training run's pieces, built from its config and mesh: the model (models/build.py), the optimizer, the abstract
train state with its shardings, and the jitted step. Training and AOT compilation both come here, so train_compile.py
compiles exactly the step that trains.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from MaxLite.config import Config
from MaxLite.layers.lora import check_matches
from MaxLite.models.build import model
from MaxLite.models.transformer import Transformer
from MaxLite.parallel import sharding as sharding_lib
from MaxLite.training import ensemble
from MaxLite.training.optimizer import create_optimizer
from MaxLite.training.train_state import abstract_state
from MaxLite.training.train_step import jit_train_step


@dataclasses.dataclass(frozen=True)
class Training:
  """Everything a training step needs besides its data. `shardings` place the state between steps (host offload
  included); `device_shardings` are the same on the device alone. `batch_sharding` places one member's batch (an
  eval batch); the step's own input is placed as sharding.batch_sharding(loaded=True) says."""

  model: Transformer
  tx: Any
  abstract: Any
  logical: Any
  device_shardings: Any
  shardings: Any
  batch_sharding: Any
  step: Any


def training(config: Config, mesh: Mesh) -> Training:
  """The run's model, optimizer, abstract train state and the jitted train step (compiled at its first call, or
  lowered by train_compile.py)."""
  model_ = model(config, deterministic=config.dropout_rate == 0.0)
  tx = create_optimizer(config)
  abstract, logical, device_shardings = abstract_state(model_, tx, config, mesh)
  if config.ensemble_size > 1:  # every member's arrays stacked on a leading axis (training/ensemble.py)
    abstract, logical, device_shardings = ensemble.stack(abstract, logical, config, mesh)
  if config.enable_lora:
    check_matches(abstract.params, config)
  shardings = sharding_lib.with_host_offload(device_shardings, config)
  batch_sharding = sharding_lib.batch_sharding(mesh, config)
  loaded = sharding_lib.batch_sharding(mesh, config, loaded=True)
  members_step = ensemble.ensemble_train_step if config.ensemble_size > 1 else None
  step = jit_train_step(config, shardings, loaded, sharding_lib.replicated(mesh), members_step)
  return Training(model_, tx, abstract, logical, device_shardings, shardings, batch_sharding, step)
