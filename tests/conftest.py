"""Test set-up: 8 simulated CPU devices and the XLA flags (set before jax is imported anywhere), the compilation cache,
the tmp_outputs fixture and the order the files run in. What test files share is in support/: none imports this file."""

import os

# The tests compile with XLA flags that make XLA's CPU compiles faster (support/fast_compile.py: which, and why).
from support.fast_compile import FAST_COMPILE

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

# One compilation cache for every test process of a session (both xdist workers): many tests compile the same small
# programs (a single-device reference step, the same layer under several layouts), and XLA's CPU compiles are a large
# part of the suite's time. Only in these processes: the train.py processes a test starts keep their own settings.
jax.config.update("jax_compilation_cache_dir", os.path.join(os.environ.get("TMPDIR", "/tmp"), "maxlite-test-xla-cache"))
# Programs of 0.1 s and more (not the many small eager ops): with FAST_COMPILE most train steps of the tiny models
# compile in under 0.5 s, jax's default threshold of 1 s would keep none of them.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_compilation_cache_max_size", 2 << 30)  # least recently used entries go first


@pytest.fixture
def tmp_outputs(tmp_path):
  return f"base_output_directory={tmp_path}"


# The suite runs with --dist loadfile: each worker takes the next file when it is free, in this order (pytest.ini's
# --no-loadscope-reorder keeps it; xdist's default puts the files with the most tests first, which left the longest
# file, end_to_end/test_gcs.py with 9 tests, for the end while the other worker idled). Files that take longest go
# first (measured with --durations on 2 cores, 2026-12-07: seconds per file roughly as listed), so the last file a
# worker gets is a short one. Real-process files alternate with in-process ones so the two workers' launches overlap
# less on two cores.
LONGEST_FILES_FIRST = (
  "end_to_end/test_readme_fine_tuning.py",  # ~220 s
  "tests/layers/test_attention.py",  # ~112 s
  "end_to_end/test_gcs.py",  # ~220 s
  "tests/parallel/test_parallelism.py",  # ~100 s
  "end_to_end/test_multiprocess.py",  # ~160 s
  "tests/parallel/test_batch_shard_layouts.py",  # ~76 s
  "end_to_end/test_kill_resume.py",  # ~140 s
  "tests/training/test_ensemble.py",  # ~74 s
  "end_to_end/test_readme_ensembles_and_processes.py",  # ~135 s
  "tests/inference/test_decode.py",  # ~74 s
  "end_to_end/test_readme_checkpoints.py",  # ~110 s
  "tests/training/test_lora.py",  # ~71 s
  "end_to_end/test_fine_tuning.py",  # ~70 s
  "tests/checkpoint/test_hf_models.py",  # ~62 s
  "end_to_end/test_readme_first_steps.py",  # ~70 s
  "tests/planning/test_plan.py",  # ~62 s
  "tests/parallel/test_context_parallelism.py",  # ~55 s
  "end_to_end/test_benchmark_and_profile.py",  # ~60 s
  "tests/training/test_run_lock.py",  # ~58 s
  "end_to_end/test_emergency_resume.py",  # ~37 s
  "tests/models/test_deepseek.py",  # ~58 s
  "tests/checkpoint/test_lora_hf.py",  # ~56 s
  "tests/parallel/test_feature_layouts.py",  # ~54 s
  "tests/checkpoint/test_checkpointing.py",  # ~52 s
  "tests/training/test_grpo.py",  # ~45 s
  "tests/training/test_memory_options.py",  # ~45 s
  "tests/aot/test_train_compile.py",  # ~45 s
  "tests/layers/test_quantization.py",  # ~40 s
  "tests/training/test_train.py",  # ~36 s
  "tests/layers/test_layer_options.py",  # ~34 s
)


# Files whose collection did not give tests (skipped for a missing package, or failed): not missing from the order.
_NOT_COLLECTED: set[str] = set()


def pytest_collectreport(report):
  if not report.passed:
    _NOT_COLLECTED.add(report.nodeid.split("::", 1)[0])


def _unknown(paths, why: str):
  if paths:
    raise pytest.UsageError(f"tests/conftest.py's LONGEST_FILES_FIRST names {why}: {paths}")


def pytest_sessionstart(session):
  """A path in LONGEST_FILES_FIRST that names no file (a test file moved or renamed) stops the session at its start,
  before an xdist worker collects."""
  _unknown([path for path in LONGEST_FILES_FIRST if not (session.config.rootpath / path).is_file()], "no file")


def pytest_collection_modifyitems(config, items):
  """Runs the files in LONGEST_FILES_FIRST's order. When the whole suite is collected, a path there that it did not
  collect stops the session too."""
  if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
    collected = {item.nodeid.split("::", 1)[0] for item in items} | _NOT_COLLECTED
    _unknown([path for path in LONGEST_FILES_FIRST if path not in collected], "files the suite does not collect")
  rank = {path: i for i, path in enumerate(LONGEST_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest as collected


def pytest_sessionfinish(session):
  """Under coverage.py (the README's "Tests"), each process saves its data at exit, and an xdist worker that takes more
  than 10 s to exit (jax's and orbax's shutdown, on a loaded machine) is killed by xdist, its data with it: here each
  worker saves what it measured as soon as its tests are done, and again at exit."""
  try:
    import coverage
  except ImportError:
    return
  measuring = coverage.Coverage.current()
  if measuring is not None:
    measuring.save()
