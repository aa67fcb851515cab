"""Notice of preemption (SIGTERM), agreed on by every process, so all save the same step; Ctrl-C and a closed terminal.

With jax.distributed running, JAX's preemption sync manager catches SIGTERM in every process and
`reached_preemption_sync_point` turns true on all of them at the same step (this is also how TPU
maintenance events arrive). A single process without jax.distributed uses a plain signal handler.

A single process also takes its first Ctrl-C (SIGINT) and a hang-up (SIGHUP: the terminal closed, an ssh session
dropped) as a preemption: it saves the step it is on and stops, instead of losing the steps since the last checkpoint
(or dying unsaved, SIGHUP's default), then exits 130 (129 for SIGHUP) so that `train && decode` does not go on as if
the run had finished; SIGTERM exits 0 once saved, as a scheduler expects. After a Ctrl-C the handler steps aside, so
a second Ctrl-C interrupts at once (exit 130, nothing saved). A job of several processes cannot agree on a signal
only some of them got, so there Ctrl-C and SIGHUP stop as before.
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
    self._previous_sighup: Any = None
    self.interrupted = False  # the stop was asked for by Ctrl-C
    _stopped_by(None)  # a new run in this process: no signal yet
    self._use_jax = jax.distributed.is_initialized()
    if not self._use_jax and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
      self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)
      if hasattr(signal, "SIGHUP"):
        self._previous_sighup = signal.signal(signal.SIGHUP, self._on_sighup)

  def _on_sigterm(self, signum: int, frame: Any) -> None:
    del signum, frame
    self._signalled = True

  def _on_sighup(self, signum: int, frame: Any) -> None:
    del frame
    self._signalled = True
    _stopped_by(signum)

  def _on_sigint(self, signum: int, frame: Any) -> None:
    del frame
    self._signalled = self.interrupted = True
    _stopped_by(signum)
    # A second Ctrl-C: KeyboardInterrupt, at once, whatever handler the process had before (a host program's, or one a
    # watcher that was never closed left behind); closing the watcher puts that one back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(
      "\nCtrl-C: the steps already started finish, then a checkpoint is saved and the run stops "
      "(Ctrl-C again stops at once, unsaved)",
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
    if self._previous_sighup is not None:
      signal.signal(signal.SIGHUP, self._previous_sighup)
      self._previous_sighup = None


_exit_code = 0


def _stopped_by(signum: int | None) -> None:
  global _exit_code
  _exit_code = 0 if signum is None else 128 + signum


def exit_code() -> int:
  """The exit status a run stopped by a signal ends with, once saved: 130 after Ctrl-C, 129 after SIGHUP, else 0
  (finished, or saved at SIGTERM's request)."""
  return _exit_code
