"""The XLA flags the tests compile with (FAST_COMPILE), probed once per test run. No jax here: tests/conftest.py
imports this before jax is first imported, and puts the flags in XLA_FLAGS."""

import os
import subprocess
import sys

# XLA's CPU compiles are most of the time of the tests' small, few-step programs, so the tests compile faster than users
# do: LLVM at optimisation level 0, XLA's older loop emitters in place of its MLIR fusion emitters (together: four
# tiny-model train steps on fsdp/tensor/expert/stage layouts compile in 2.6 s instead of 6.4 on this 2-core VM), and one
# LLVM module per program, not parts for XLA's thread pool (both cores already run a test each, so parts only add
# work). The programs compute the same functions: the equivalence tests compare runs that all use these flags, and the
# golden losses hold to their tolerance. What users run is compiled with XLA's defaults, whose steps run about twice as
# fast (configs/bench.yml: 0.29 s a step against 0.63 here). Processes a test starts on one device get FAST_COMPILE
# alone; those on several devices keep these flags (end_to_end/procs.py).
_FAST_COMPILE_FLAGS = (
  "--xla_backend_optimization_level=0",
  "--xla_cpu_use_fusion_emitters=false",
  "--xla_cpu_parallel_codegen_split_count=1",
)


def flags_this_xla_knows(flags: tuple[str, ...], cache_env: str = "MAXLITE_TEST_FAST_COMPILE") -> str:
  """`flags` less those this jaxlib's XLA does not define. XLA aborts a process at start on a flag it does not know,
  and jax 0.11 removed the older loop emitters with their flag (the GPU machines run jax 0.11.2: there the tests
  compile at LLVM level 0 alone). Probed in a child process once per test run; the answer travels to the
  xdist workers in the environment (`cache_env`)."""
  cached = os.environ.get(cache_env)
  if cached is not None:
    return cached

  def accepted(chosen: tuple[str, ...]) -> bool:
    env = dict(os.environ, XLA_FLAGS=" ".join(chosen), JAX_PLATFORMS="cpu")
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True).returncode == 0

  known = " ".join(flags if accepted(flags) else [flag for flag in flags if accepted((flag,))])
  os.environ[cache_env] = known
  return known


FAST_COMPILE = flags_this_xla_knows(_FAST_COMPILE_FLAGS)
