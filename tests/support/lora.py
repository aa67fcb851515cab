"""The LoRA settings and the MaxLite LoRA model's logits that the PEFT tests share (tests/checkpoint/test_lora_hf.py,
tests/models/test_gpt_oss.py). Needs Qwix: a test file that imports this at module level is skipped without it."""

import jax
import numpy as np
import pytest
from flax.linen import partitioning as nn_partitioning

from MaxLite.parallel import sharding as sharding_lib
from MaxLite.parallel.mesh import create_mesh
from MaxLite.training import builder
from MaxLite.training.train_state import model_params
from MaxLite.training.trainer import initial_state
from support.config import first_devices

pytest.importorskip("qwix")

LORA = ("enable_lora=true", "lora_rank=4", "lora_alpha=12")  # scale 3: a mix-up of alpha/r cannot pass
ATTENTION_ONLY = r"lora_module_path=(decoder/\w*layers(_\d+)?/)?self_attention/\w+"


def lora_logits(config, ids):
  """MaxLite's LoRA model (adapters applied by Qwix, not merged) at the run's starting state, and that state."""
  mesh = create_mesh(config, first_devices(1))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    pieces = builder.training(config, mesh)
    state, _ = initial_state(config, pieces)
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    logits = pieces.model.apply({"params": model_params(state)}, ids, pos, np.ones_like(ids))
  return np.asarray(logits), state
