"""profiler=xplane: the trace ends only when the traced steps have run, not when the last of them was dispatched."""

import os

import jax
import jax.numpy as jnp
from support.config import REPO

from MaxLite.config import load_config
from MaxLite.training import profiler as profiler_lib


def _slow_step(x: jax.Array) -> jax.Array:
  # ~0.5-1 s of CPU work: still running when the host has dispatched it and moved on.
  return jax.lax.fori_loop(0, 40, lambda _, y: jnp.tanh(y @ y) * 0.5, x)


def test_the_trace_stops_after_the_traced_step_has_computed(tmp_path, monkeypatch):
  config = load_config(
    [
      os.path.join(REPO, "configs", "base.yml"),
      "model_name=tiny",
      "profiler=xplane",
      "skip_first_n_steps_for_profiler=1",
      "profiler_steps=1",
      f"base_output_directory={tmp_path}",
      "run_name=p",
    ],
    num_devices=1,
    num_slices=1,
    process_count=1,
  )
  ready_at_stop = []
  real_stop = jax.profiler.stop_trace

  def stop_trace():
    ready_at_stop.append(state.is_ready())
    real_stop()

  monkeypatch.setattr(jax.profiler, "stop_trace", stop_trace)
  step = jax.jit(_slow_step)
  x = jnp.ones((512, 512)) / 512
  step(x).block_until_ready()  # compiled before the trace
  with profiler_lib.Profiler(config) as profiler:
    profiler.before_step(1, None)  # starts the trace
    state = step(x)  # step 1, dispatched; the device is still on it
    profiler.before_step(2, state)  # the trace covers steps [1, 2): it stops here
  assert ready_at_stop == [True]
