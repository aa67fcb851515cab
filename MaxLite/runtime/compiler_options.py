"""How MaxLite's programs are compiled: XLA options per platform (what a GPU recipe would otherwise put in XLA_FLAGS)
and the persistent compilation cache."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
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


# jax caches only programs that took at least this long to compile (its default is 1 s).
CACHE_MIN_COMPILE_S = 0.1
_MIN_COMPILE_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def use_compilation_cache(directory: str, environ: Mapping[str, str] = os.environ) -> None:
  """Compiled programs are kept in `directory` (jax_cache_dir) and a re-launch reads them back.

  jax keeps only programs that took 1 s or more to compile; a small model's train step compiles in less, so its
  re-launches compiled everything again (model_name=tiny: 3.7-4.2 s a launch, 2.6-2.8 s with programs of 0.1 s and
  more kept). A threshold the user set in the environment stands."""
  import jax

  jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
  if _MIN_COMPILE_ENV not in environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_S)
