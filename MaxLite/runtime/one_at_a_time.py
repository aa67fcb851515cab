"""Simulated CPU devices run a program's executions one at a time.

jax dispatches the next call of a jitted program before the last one has finished: on accelerators that keeps them
busy. On XLA:CPU each simulated device (`--xla_force_host_platform_device_count`) is a thread that runs its part of
each execution as soon as its inputs are ready, so one device can be in call n + 1 while another is still in call n.
Where a program's collectives sit in loops (ring attention's blocks passed around the sequence shards, in a while
loop per layer and per microbatch), the devices then wait for each other at different collectives until XLA's
rendezvous gives up and aborts the process (XLA's "Termination timeout for `collective permute ...` of 40 seconds
exceeded", then Python's "Fatal Python error: Aborted"). A pod simulated on a laptop waits for each call to finish
instead, giving up only the overlap of one step's dispatch with the last one's run. (Within one call, two rings side
by side can still meet that abort in rare runs: the README's long-context section says when.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax


def needed(devices: Iterable[Any]) -> bool:
  """Whether calls of a program on `devices` must not overlap: more than one CPU device."""
  devices = list(devices)
  return len(devices) > 1 and all(device.platform == "cpu" for device in devices)


def calls(fn: Callable[..., Any], devices: Iterable[Any]) -> Callable[..., Any]:
  """`fn` (a jitted program on `devices`), each call returning once its results are ready where `needed`; `fn` itself
  elsewhere."""
  if not needed(devices):
    return fn

  def waited(*args: Any, **kwargs: Any) -> Any:
    return jax.block_until_ready(fn(*args, **kwargs))

  return waited
