"""A jax.profiler trace of steps [skip_first_n_steps_for_profiler, + profiler_steps) into the tensorboard dir, taken by
process 0 when profiler=xplane; otherwise it does nothing."""

from __future__ import annotations

from typing import Any

import jax

from MaxLite.config import Config


class Profiler:
  def __init__(self, config: Config):
    self._on = config.profiler == "xplane" and jax.process_index() == 0
    self._first = config.skip_first_n_steps_for_profiler
    self._last = config.skip_first_n_steps_for_profiler + config.profiler_steps
    self._dir, self._active = config.tensorboard_dir, False

  def before_step(self, step: int, state: Any = None) -> None:
    """`state`: what the previous step returned. The trace stops only once it is computed: steps are dispatched
    ahead of the device, so stopping at once would cut the traced steps short (on an H200, a 0.7 s step's trace held
    its first 15 ms)."""
    if self._on and step == self._first:
      jax.profiler.start_trace(self._dir)
      self._active = True
    if self._active and step == self._last:
      self.stop(state)

  def stop(self, state: Any = None) -> None:
    if self._active:
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
      self._active = False

  def __enter__(self) -> Profiler:
    return self

  def __exit__(self, *exc: object) -> None:
    self.stop()
