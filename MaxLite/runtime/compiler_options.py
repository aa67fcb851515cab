"""XLA options MaxLite compiles its steps with, per platform: what a GPU recipe would otherwise put in XLA_FLAGS."""

from __future__ import annotations

import os
import re
from typing import Any

from MaxLite.config import Config

TRITON_GEMM = "xla_gpu_enable_triton_gemm"


def step_compiler_options(config: Config, platform: str, xla_flags: str | None = None) -> dict[str, Any]:
  """Options for jax.jit(compiler_options=...) of a step that runs on `platform` ("gpu", "tpu", "cpu").

  On a GPU, XLA's autotuner may compile a dot, with the casts and reshapes fused into it, as a Triton GEMM instead of
  calling cuBLAS. On an H200 (jax 0.11.2, Llama 3.2 1B, 8 x 4096, remat full) four such fusions took 184 ms of a
  0.738 s step; with them off the step took 0.654 s (and compiled in 3.9 s instead of 11.1). MaxText's GPU recipes
  set the same flag in XLA_FLAGS; here `gpu_triton_gemm` says it once for every command. A flag the user put in
  XLA_FLAGS is theirs: it is not overridden."""
  if platform != "gpu":
    return {}
  flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  if re.search(rf"--{TRITON_GEMM}\b", flags):
    return {}
  return {TRITON_GEMM: config.gpu_triton_gemm}
