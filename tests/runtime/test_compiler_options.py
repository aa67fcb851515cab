"""gpu_triton_gemm: the XLA option a GPU step is compiled with, and that the train and eval steps carry it; the
persistent compilation cache keeps a small model's programs too."""

import os

import jax
import jax.numpy as jnp
import pytest
from support.config import first_devices, make_config, run_train_cli

from MaxLite.aot.compile_step import lower_train_step
from MaxLite.runtime import compiler_options
from MaxLite.training import train_step


def test_a_gpu_step_calls_cublas_unless_asked_or_the_user_set_the_flag():
  on = make_config("gpu_triton_gemm=true")
  off = make_config()
  assert compiler_options.step_compiler_options(off, "gpu", "") == {"xla_gpu_enable_triton_gemm": False}
  assert compiler_options.step_compiler_options(on, "gpu", "") == {"xla_gpu_enable_triton_gemm": True}
  # XLA_FLAGS' own setting is the user's: either value, left alone; other flags do not count
  for flags in ("--xla_gpu_enable_triton_gemm=true", "--a=1 --xla_gpu_enable_triton_gemm=false"):
    assert compiler_options.step_compiler_options(off, "gpu", flags) == {}
  assert compiler_options.step_compiler_options(off, "gpu", "--xla_gpu_enable_triton_gemm_any=1") == {
    "xla_gpu_enable_triton_gemm": False
  }
  for platform in ("cpu", "tpu"):
    assert compiler_options.step_compiler_options(on, platform, "") == {}


def test_xla_knows_the_option_by_that_name():
  # XLA refuses an option it does not know ("No such compile option"); its CPU compiler reads the same option table
  options = compiler_options.step_compiler_options(make_config(), "gpu", "")
  assert jax.jit(lambda x: x @ x, compiler_options=options)(jnp.eye(4)).sum() == 4


def test_the_train_step_is_compiled_with_the_options(monkeypatch):
  seen = []

  def options(config, platform):
    seen.append(platform)
    return {"xla_no_such_option_maxlite": True}

  monkeypatch.setattr(train_step, "step_compiler_options", options)
  lowered, _ = lower_train_step(make_config("model_name=tiny", "max_target_length=32"), first_devices(1))
  with pytest.raises(Exception, match="xla_no_such_option_maxlite"):
    lowered.compile()
  assert seen == ["cpu"]


@pytest.mark.slow
def test_the_cache_keeps_programs_that_compile_in_under_a_second(tmp_path):
  # jax's own threshold (1 s) kept none of a tiny model's programs, so every re-launch compiled them all again
  cache = tmp_path / "cache"
  done = run_train_cli(
    "model_name=tiny",
    "max_target_length=64",
    "steps=2",
    f"base_output_directory={tmp_path}",
    "run_name=r",
    "enable_checkpointing=false",
    f"jax_cache_dir={cache}",
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert len(list(cache.iterdir())) >= 2, sorted(p.name for p in cache.iterdir())


def test_a_threshold_the_user_set_stands():
  before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
  try:
    compiler_options.use_compilation_cache("/tmp/x", {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "5"})
    assert jax.config.jax_persistent_cache_min_compile_time_secs == before[1]
    compiler_options.use_compilation_cache("~/c", {})
    assert jax.config.jax_persistent_cache_min_compile_time_secs == compiler_options.CACHE_MIN_COMPILE_S
    assert jax.config.jax_compilation_cache_dir == os.path.expanduser("~/c")
  finally:
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
