"""The XLA flags the tests compile with (FAST_COMPILE), probed once per test run. No jax here: tests/conftest.py
imports this before jax is first imported, and puts the flags in XLA_FLAGS."""

import os
import subprocess
import sys

# XLA's CPU compiles are most of the time of the tests' small, few-step programs, so the tests compile faster than users
# do: LLVM at optimisation level 0, and XLA's older loop emitters in place of its MLIR fusion emitters
# (`--xla_cpu_use_fusion_emitters=false`: four tiny-model train steps, fsdp/tensor/expert/stage layouts, compiled in
# 2.6 s instead of 6.4; tests/parallel/test_parallelism.py with end_to_end/test_kill_resume.py on a cold cache in 135 s
# instead of 163; the older emitters alone, at LLVM's default level, took 178). The programs compute the same functions
# (the equivalence tests compare runs that all use these flags; the golden losses hold to their tolerance); what users
# run is compiled with XLA's defaults, whose steps run faster (configs/bench.yml: 0.29 s a step against 0.63 here).
# Processes a test starts on one device get FAST_COMPILE alone; those on several devices keep these flags
# (end_to_end/procs.py). XLA:CPU also splits each program's LLVM module into parts for its thread pool; here both cores
# already run a test each, so the parts only add work (`--xla_cpu_parallel_codegen_split_count=1`: test_parallelism,
# test_layer_options and test_deepseek on a cold cache in 97-100 s instead of 106-109).
_FAST_COMPILE_FLAGS = (
  "--xla_backend_optimization_level=0",
  "--xla_cpu_use_fusion_emitters=false",
  "--xla_cpu_parallel_codegen_split_count=1",
)


def flags_this_xla_knows(flags: tuple[str, ...]) -> str:
  """`flags` less those this jaxlib's XLA does not define. XLA aborts a process at start on a flag it does not know,
  and jax 0.11 removed the older loop emitters with their flag (the GPU machines run jax 0.11.2: there the tests
  compile at LLVM level 0 alone; a tiny-model train step 2.6 s instead of 3.3 with XLA's defaults, against 1.2 s
  with the older emitters on jax 0.10.2). Probed in a child process once per test run; the answer travels to the
  xdist workers in the environment."""
  cached = os.environ.get("MAXLITE_TEST_FAST_COMPILE")
  if cached is not None:
    return cached

  def accepted(chosen: tuple[str, ...]) -> bool:
    env = dict(os.environ, XLA_FLAGS=" ".join(chosen), JAX_PLATFORMS="cpu")
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True).returncode == 0

  known = " ".join(flags if accepted(flags) else [flag for flag in flags if accepted((flag,))])
  os.environ["MAXLITE_TEST_FAST_COMPILE"] = known
  return known


FAST_COMPILE = flags_this_xla_knows(_FAST_COMPILE_FLAGS)
