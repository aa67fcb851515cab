"""How long a checkpoint save blocks the train loop (async on and off) and how long a restore takes.

  python end_to_end/bench_checkpoint.py [key=value ...]

Default model: ~100M parameters (12 layers, emb 768), float32, Adam state included (~1.2 GB on disk).
Prints one JSON line per mode.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import jax
from flax.linen import partitioning as nn_partitioning

from MaxLite.checkpoint import manager as checkpointing
from MaxLite.config import load_config
from MaxLite.data.input_pipeline import make_iterator
from MaxLite.models.transformer import Transformer
from MaxLite.parallel import sharding
from MaxLite.parallel.mesh import create_mesh
from MaxLite.training.optimizer import create_optimizer
from MaxLite.training.train_state import abstract_state, create_train_state, total_bytes

BASE_YML = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.yml")
MODEL_100M = (
  "base_emb_dim=768",
  "base_num_query_heads=12",
  "base_num_kv_heads=12",
  "head_dim=64",
  "base_mlp_dim=2048",
  "base_num_decoder_layers=12",
  "vocab_size=8192",
  "dataset_type=synthetic",
  "max_target_length=128",
  "per_device_batch_size=1",
)


def _bench(overrides: list[str], out_dir: str, async_on: bool) -> dict:
  config = load_config(
    [
      BASE_YML,
      *MODEL_100M,
      *overrides,
      f"base_output_directory={out_dir}",
      f"run_name=async_{async_on}",
      "enable_checkpointing=true",
      f"async_checkpointing={str(async_on).lower()}",
    ]
  )
  mesh = create_mesh(config)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding.axis_rules(config)):
    model, tx = Transformer(config), create_optimizer(config)
    abstract, _, shardings = abstract_state(model, tx, config, mesh)
    state = create_train_state(model, tx, config, shardings)
    jax.block_until_ready(state)
    batches = make_iterator(config, mesh)
    manager = checkpointing.create_manager(config)
    start = time.perf_counter()
    checkpointing.save(manager, 1, state, batches, config)
    blocked = time.perf_counter() - start
    manager.wait_until_finished()
    total = time.perf_counter() - start
    manager.close()
    del state
    manager = checkpointing.create_manager(config)
    start = time.perf_counter()
    restored = checkpointing.restore(manager, 1, checkpointing.sharded_target(abstract, shardings), batches)
    jax.block_until_ready(restored)
    restore_s = time.perf_counter() - start
    manager.close()
  return {
    "async_checkpointing": async_on,
    "params": config.num_params,
    "state_bytes": total_bytes(restored),
    "save_blocks_loop_s": round(blocked, 3),
    "save_total_s": round(total, 3),
    "restore_s": round(restore_s, 3),
  }


def main() -> None:
  out_dir = tempfile.mkdtemp(prefix="bench_checkpoint_")
  try:
    for async_on in (True, False):
      print(json.dumps(_bench(sys.argv[1:], out_dir, async_on)), flush=True)
  finally:
    shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
  main()
