"""Step time and per-device memory of each parallelism layout on 8 simulated CPU devices.

  python end_to_end/bench_layouts.py [key=value ...]

Default: the tiny model with 8 query/kv heads (so tensor=8 divides them) and 4 layers (so 2
stages hold 2 layers each), seq 128, global batch 16, synthetic data. The tiny-moe model is used
for the expert layouts. Prints one JSON line per layout: median step time after warm-up,
params + optimizer bytes per device (from the shardings) and the compiled step's temporary bytes
per device (XLA's memory analysis). Simulated devices share 2 CPU cores, so the step times show
the cost of each layout's communication and bubbles, not a speed-up.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from MaxLite.aot.compile_step import lower_train_step
from MaxLite.config import load_config
from MaxLite.config.choices import MESH_AXES
from MaxLite.training.trainer import train

BASE_YML = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.yml")
DENSE = ("model_name=tiny", "base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=8", "base_num_decoder_layers=4")
MOE = ("model_name=tiny-moe", "base_num_decoder_layers=4")
COMMON = (
  "max_target_length=128",
  "per_device_batch_size=2",
  "dataset_type=synthetic",
  "steps=8",
  "enable_tensorboard=false",
  "eval_interval=-1",
  "log_period=100",
  "jax_cache_dir=",
)
LAYOUTS = {
  "fsdp8": DENSE + ("ici_fsdp_parallelism=8",),
  "data8": DENSE + ("ici_data_parallelism=8", "ici_fsdp_parallelism=1"),
  "tensor8": DENSE + ("ici_tensor_parallelism=8", "ici_fsdp_parallelism=1"),
  "tensor2_fsdp4": DENSE + ("ici_tensor_parallelism=2", "ici_fsdp_parallelism=4"),
  "sequence4_fsdp2": DENSE + ("ici_sequence_parallelism=4", "ici_fsdp_parallelism=2"),
  "stage2_fsdp4": DENSE + ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"),
  "stage2_fsdp4_micro4": DENSE
  + ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_microbatches=4"),
  "stage2_tensor2_data2": DENSE
  + ("ici_pipeline_parallelism=2", "ici_tensor_parallelism=2", "ici_data_parallelism=2", "ici_fsdp_parallelism=1"),
  "moe_fsdp8": MOE + ("ici_fsdp_parallelism=8",),
  "moe_expert4_fsdp2": MOE + ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2"),
}


def _memory(config) -> dict:
  lowered, state_bytes = lower_train_step(config, jax.devices())
  analysis = lowered.compile().memory_analysis()
  return {
    "params_bytes_per_device": state_bytes["params"],
    "optimizer_bytes_per_device": state_bytes["optimizer"],
    "compiled_temp_bytes_per_device": int(analysis.temp_size_in_bytes),
  }


def main(argv: list[str]) -> None:
  wanted = [a for a in argv if "=" not in a] or list(LAYOUTS)
  overrides = [a for a in argv if "=" in a]
  for name in wanted:
    with tempfile.TemporaryDirectory() as out:
      config = load_config(
        [BASE_YML, *COMMON, *LAYOUTS[name], *overrides, f"base_output_directory={out}", "run_name=bench"]
      )
      rows = train(config)
    step_times = [r["step_time_s"] for r in rows[2:]]  # step 1 compiles, step 2 may still warm up
    result = {
      "layout": name,
      "mesh": {k: v for k, v in zip(MESH_AXES, config.mesh_shape) if v > 1},
      "median_step_s": round(statistics.median(step_times), 4),
      "tokens_per_s": round(
        config.global_batch_size_to_train_on * config.max_target_length / statistics.median(step_times)
      ),
      **_memory(config),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
