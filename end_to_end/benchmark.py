"""Train a benchmark config for a few steps and print one JSON line: throughput, MFU, compile time, RSS.

  python end_to_end/benchmark.py [configs/bench.yml] [key=value ...]

Its outputs (metrics, a profile with profiler=xplane) go to a temporary directory unless base_output_directory is set.

MFU is measured against this machine's own dense-matmul peak, timed in the same process (a jitted
2048x2048 matmul in the config's activation dtype), so the number means the same on a laptop and
on an accelerator. On a chip whose published bf16 peak is known (a TPU generation, H100/H200/A100/B200) `mfu`
is against that peak too: a 2048-cube matmul is too small to reach a GPU's (134 of 989 TFLOP/s on an H200).
Steps 1-3 (compile and warm-up) are left out of the median.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import time

from MaxLite.runtime import allocator

if __name__ == "__main__":
  allocator.reexec_with_tcmalloc()  # the allocator a training run uses (train.py does the same)

_START = time.perf_counter()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax

from MaxLite.config import load_config
from MaxLite.layers.quantities import dtype_of
from MaxLite.models import flops
from MaxLite.parallel import topologies
from MaxLite.training.trainer import train

WARMUP_STEPS = 3


def matmul_peak_tflops(dtype: str, n: int = 2048, repeats: int = 10) -> float:
  """Best-of-`repeats` TFLOP/s of one jitted n x n x n matmul on the default device."""
  a = jax.random.normal(jax.random.key(0), (n, n), dtype_of(dtype))
  b = jax.random.normal(jax.random.key(1), (n, n), dtype_of(dtype))
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, b).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best / 1e12


def _chip_mfu(tflops_per_device: float) -> dict[str, float]:
  """MFU against the chip's published bf16 peak, where the chip is known; nothing otherwise."""
  device = jax.devices()[0]
  chip = topologies.device_chip(device)
  if chip is None:
    return {}
  return {"chip_peak_tflops": chip.peak_bf16_tflops, "mfu": round(tflops_per_device / chip.peak_bf16_tflops, 4)}


def main(argv: list[str]) -> None:
  config_path = argv[0] if argv and "=" not in argv[0] else os.path.join(REPO, "configs", "bench.yml")
  overrides = [a for a in argv if "=" in a]
  named = {a.split("=", 1)[0] for a in overrides}
  with tempfile.TemporaryDirectory() as out:
    # The run's files go to a temporary directory unless the command line names one (to keep a profile, say).
    outputs = [] if "base_output_directory" in named else [f"base_output_directory={out}"]
    outputs += [] if "run_name" in named else ["run_name=bench"]
    config = load_config([config_path, *overrides, *outputs])
    if config.steps <= WARMUP_STEPS:
      raise SystemExit(f"error: steps={config.steps} must be > {WARMUP_STEPS} (the warm-up steps)")
    measure_start = time.perf_counter()
    peak = matmul_peak_tflops(config.dtype)
    measuring = time.perf_counter() - measure_start
    rows = [r for r in train(config) if "loss" in r]
    trained = time.perf_counter()
  # Each step's time runs from the previous step's finish, so what precedes steps 2..N is launch,
  # imports, set-up, compilation and step 1 (plus a moment of tear-down at the end); the matmul
  # measurement is not part of a training launch.
  launch_to_first_step = trained - _START - measuring - sum(r["step_time_s"] for r in rows[1:])
  step_s = statistics.median(r["step_time_s"] for r in rows[WARMUP_STEPS:])
  tokens = config.global_batch_size_to_train_on * config.ensemble_size * config.max_target_length  # every member's
  tflops_per_device = flops.tflops_per_device_per_step(config) / step_s
  print(
    json.dumps(
      {
        "config": os.path.relpath(config_path, REPO),
        "overrides": overrides,
        "devices": config.num_devices,
        "ensemble_size": config.ensemble_size,
        "dtype": config.dtype,
        "model_params": config.num_params,
        "tokens_per_step": tokens,
        "steps_timed": len(rows) - WARMUP_STEPS,
        "median_step_s": round(step_s, 6),
        "tokens_per_s": round(tokens / step_s, 1),
        "tflops_per_device": round(tflops_per_device, 4),
        "matmul_peak_tflops": round(peak, 4),
        "mfu_vs_matmul_peak": round(tflops_per_device / peak, 4),
        **_chip_mfu(tflops_per_device),
        "first_step_s": round(rows[0]["step_time_s"], 2),
        "launch_to_first_step_s": round(launch_to_first_step, 2),
        "allocator": "tcmalloc" if "tcmalloc" in os.environ.get("LD_PRELOAD", "") else "system",
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
      }
    ),
    flush=True,
  )


if __name__ == "__main__":
  main(sys.argv[1:])
