"""One process of a 2-process job that trains on a mesh built from a chosen device order.

  python end_to_end/device_order_worker.py ORDER PORT PROCESS_ID OUT_DIR key=value ...

ORDER is `contiguous` (process 0's devices first, as on CPU and small TPU slices) or `interleaved`
(hosts alternate every 2 devices along the batch, as mesh_utils orders v5p-32 and larger), so process 0
holds batch rows 0-1 and 4-5. Process 0 writes the losses; each process writes the rows it fed.
"""

import json
import os
import sys

import jax

from MaxLite.config import load_config
from MaxLite.data.input_pipeline import process_rows
from MaxLite.parallel.mesh import create_mesh
from MaxLite.parallel.sharding import batch_sharding
from MaxLite.training.trainer import train

BASE_YML = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.yml")


def device_order(order: str) -> list:
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  if order == "contiguous":
    return devices
  by_process = [[d for d in devices if d.process_index == p] for p in range(jax.process_count())]
  pairs = [group[i : i + 2] for i in range(0, len(by_process[0]), 2) for group in by_process]
  return [d for pair in pairs for d in pair]


def main(order: str, port: str, process_id: str, out_dir: str, *overrides: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id))
  config = load_config([BASE_YML, *overrides])
  devices = device_order(order)
  mesh = create_mesh(config, devices)
  sharding = batch_sharding(mesh, config)
  fed = {"rows": list(process_rows(sharding, config.global_batch_size_to_train_on))}
  with open(os.path.join(out_dir, f"rows_{order}_{process_id}.json"), "w") as f:
    json.dump(fed, f)
  rows = train(config, devices)
  if jax.process_index() == 0:
    with open(os.path.join(out_dir, f"losses_{order}.json"), "w") as f:
      json.dump([r["loss"] for r in rows if "loss" in r], f)


if __name__ == "__main__":
  main(*sys.argv[1:])
