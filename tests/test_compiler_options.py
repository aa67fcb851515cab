"""gpu_triton_gemm: the XLA option a GPU step is compiled with, and that the train and eval steps carry it."""

import jax
import jax.numpy as jnp
import pytest
from conftest import first_devices, make_config

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
