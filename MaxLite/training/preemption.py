"""Notice of preemption (SIGTERM), agreed on by every process, so all save the same step; and Ctrl-C.

With jax.distributed running, JAX's preemption sync manager catches SIGTERM in every process and
`reached_preemption_sync_point` turns true on all of them at the same step (this is also how TPU
maintenance events arrive). A single process without jax.distributed uses a plain signal handler.

A single process also takes its first Ctrl-C (SIGINT) as a preemption: it says so, saves the step it is on and stops,
instead of losing the steps since the last checkpoint; the handler then steps aside, so a second Ctrl-C interrupts
at once (exit 130, nothing saved). A job of several processes cannot agree on a signal only some of them got, so
there Ctrl-C stops as before.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

import jax
from absl import logging
from jax.experimental import multihost_utils

from MaxLite.cli.errors import first_line


class PreemptionWatcher:
  def __init__(self) -> None:
    self._signalled = False
    self._unavailable = False  # the preemption service failed once: said so, and not asked again
    self._previous: Any = None
    self._previous_sigint: Any = None
    self.interrupted = False  # the stop was asked for by Ctrl-C
    self._use_jax = jax.distributed.is_initialized()
    if not self._use_jax and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
      self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)

  def _on_sigterm(self, signum: int, frame: Any) -> None:
    del signum, frame
    self._signalled = True

  def _on_sigint(self, signum: int, frame: Any) -> None:
    del signum, frame
    self._signalled = self.interrupted = True
    # A second Ctrl-C: KeyboardInterrupt, at once, whatever handler the process had before (a host program's, or one a
    # watcher that was never closed left behind); closing the watcher puts that one back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(
      "\nCtrl-C: saving a checkpoint when this step ends, then stopping (Ctrl-C again stops at once, unsaved)",
      file=sys.stderr,
      flush=True,
    )

  def reached(self, step: int) -> bool:
    """Call once per step on every process; true at the step where all should save and stop."""
    if self._use_jax and not self._unavailable:
      try:
        return multihost_utils.reached_preemption_sync_point(step)
      except RuntimeError as e:  # jax.distributed started without its preemption service
        self._unavailable = True
        logging.warning(
          "preemption notices are off: JAX's preemption sync service does not answer (%s); a SIGTERM will stop "
          "this run without saving a checkpoint first",
          first_line(e, with_type=True),
        )
    return self._signalled

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
    if self._previous_sigint is not None:
      signal.signal(signal.SIGINT, self._previous_sigint)
      self._previous_sigint = None
