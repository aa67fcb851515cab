"""Test set-up: 8 simulated CPU devices (must be set before jax is imported anywhere)."""

import os

# XLA's CPU compiles are most of the time of the tests' small, few-step programs, so the tests compile faster than
# users do: LLVM at optimisation level 0, and XLA's older loop emitters in place of its MLIR fusion emitters
# (`--xla_cpu_use_fusion_emitters=false`: four tiny-model train steps, fsdp/tensor/expert/stage layouts, compiled in
# 2.6 s instead of 6.4; tests/test_parallelism.py with end_to_end/test_kill_resume.py on a cold cache in 135 s instead
# of 163; the older emitters alone, at LLVM's default level, took 178). The programs compute the same functions (the
# equivalence tests compare runs that all use these flags; the golden losses hold to their tolerance); what users run
# is compiled with XLA's defaults, whose steps run faster (configs/bench.yml: 0.29 s a step against 0.63 here).
# Processes a test starts on one device get FAST_COMPILE alone; those on several devices keep these flags
# (end_to_end/procs.py). XLA:CPU also splits each program's LLVM module into parts for its thread pool; here both cores
# already run a test each, so the parts only add work (`--xla_cpu_parallel_codegen_split_count=1`: test_parallelism,
# test_layer_options and test_deepseek on a cold cache in 97-100 s instead of 106-109).
_FAST_COMPILE_FLAGS = (
  "--xla_backend_optimization_level=0",
  "--xla_cpu_use_fusion_emitters=false",
  "--xla_cpu_parallel_codegen_split_count=1",
)


def _flags_this_xla_knows(flags: tuple[str, ...]) -> str:
  """`flags` less those this jaxlib's XLA does not define. XLA aborts a process at start on a flag it does not know,
  and jax 0.11 removed the older loop emitters with their flag (the GPU machines run jax 0.11.2: there the tests
  compile at LLVM level 0 alone; a tiny-model train step 2.6 s instead of 3.3 with XLA's defaults, against 1.2 s
  with the older emitters on jax 0.10.2). Probed in a child process once per test run; the answer travels to the
  xdist workers in the environment."""
  import subprocess
  import sys

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


FAST_COMPILE = _flags_this_xla_knows(_FAST_COMPILE_FLAGS)
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import subprocess
import sys

import jax
import pytest

# One compilation cache for every test process of a session (both xdist workers): many tests compile the same small
# programs (a single-device reference step, the same layer under several layouts), and XLA's CPU compiles are a large
# part of the suite's time. Only in these processes: the train.py processes a test starts keep their own settings.
jax.config.update("jax_compilation_cache_dir", os.path.join(os.environ.get("TMPDIR", "/tmp"), "maxlite-test-xla-cache"))
# Programs of 0.1 s and more (not the many small eager ops): with FAST_COMPILE most train steps of the tiny models
# compile in under 0.5 s, the threshold this had before, so they were compiled again by every test and every run
# (tests/test_lora.py, test_ensemble.py, test_checkpointing.py, test_parallelism.py with a warm cache: 136 s -> 110 s).
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_compilation_cache_max_size", 2 << 30)  # least recently used entries go first

from MaxLite.config import load_config

BASE_YML = os.path.join(REPO, "configs", "base.yml")


def make_config(*overrides: str, num_devices: int = 1):
  """Config for `num_devices` of the simulated devices (one process, one slice); overrides are key=value."""
  return load_config([BASE_YML, *overrides], num_devices=num_devices, num_slices=1, process_count=1)


def first_devices(n: int):
  return jax.devices()[:n]


@pytest.fixture
def tmp_outputs(tmp_path):
  return f"base_output_directory={tmp_path}"


def run_train_cli(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
  """`python MaxLite/train.py configs/base.yml key=value ...` from the repo root on one CPU device."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
  command = [sys.executable, "MaxLite/train.py", "configs/base.yml", *overrides]
  return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def read_records(paths: list[str]) -> list[str]:
  """The UTF-8 records of ArrayRecord files, files sorted by path (read with the plain reader, not MaxLite's)."""
  from array_record.python.array_record_module import ArrayRecordReader

  out = []
  for path in sorted(paths):
    reader = ArrayRecordReader(path)
    out += [r.decode() for r in reader.read_all()]
    reader.close()
  return out


# The suite runs with --dist loadfile: each worker takes the next file when it is free, in this order (pytest.ini's
# --no-loadscope-reorder keeps it; xdist's default puts the files with the most tests first, which left the longest
# file, test_gcs.py with 9 tests, for the end while the other worker idled). Files that take longest go first
# (measured with --durations on 2 cores: seconds per file roughly as listed), so the last file a worker gets is a
# short one. Real-process files alternate with in-process ones so the two workers' launches overlap less on two cores.
LONGEST_FILES_FIRST = (
  "end_to_end/test_readme_as_written.py",  # ~340 s
  "end_to_end/test_gcs.py",  # ~330 s
  "tests/test_quantization.py",  # ~150 s
  "end_to_end/test_multiprocess.py",  # ~260 s
  "tests/test_attention.py",  # ~130 s
  "end_to_end/test_fine_tuning.py",  # ~130 s
  "tests/test_deepseek.py",  # ~75 s
  "tests/test_hf_models.py",  # ~50 s
  "tests/test_plan.py",  # ~110 s
  "tests/test_ensemble.py",  # ~110 s
  "tests/test_lora.py",  # ~100 s
  "tests/test_parallelism.py",  # ~100 s
  "end_to_end/test_kill_resume.py",  # ~100 s
  "tests/test_memory_options.py",
  "end_to_end/test_benchmark_and_profile.py",
  "tests/test_cli.py",
  "end_to_end/test_emergency_resume.py",
  "tests/test_training_math.py",
  "tests/test_checkpointing.py",
  "end_to_end/test_decode_cli.py",
  "tests/test_layer_options.py",
)


def pytest_collection_modifyitems(items):
  rank = {path: i for i, path in enumerate(LONGEST_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest as collected
