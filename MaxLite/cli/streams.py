"""Standard output and error that a run outlives: a write that fails (the reader of a pipe gone, as `| tee log` is when
the terminal's Ctrl-C ends tee too; a full disk under a redirected log; a terminal that went away) drops that stream's
output from then on instead of raising into the training loop, so saving a checkpoint never depends on where the
log goes. Python already ignores SIGPIPE, so a closed pipe arrives as BrokenPipeError from the write."""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO


class _Outlived:
  """A text stream that turns its first failed write or flush into silence (os.devnull) for the rest of the run."""

  def __init__(self, stream: TextIO) -> None:
    self._stream = stream
    self.failed: str | None = None  # why the stream went quiet: the first error, for anyone who asks

  def write(self, text: str) -> int:
    try:
      return self._stream.write(text)
    except (OSError, ValueError) as e:  # ValueError: the stream was closed under us
      self._give_up(e)
      return len(text)

  def flush(self) -> None:
    try:
      self._stream.flush()
    except (OSError, ValueError) as e:
      self._give_up(e)

  def _give_up(self, error: Exception) -> None:
    if self.failed is None:
      self.failed = f"{type(error).__name__}: {error}"
    # The broken stream may still hold buffered text; it is left to be collected, never flushed again by us.
    self._stream = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process

  def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...: the stream's own
    return getattr(self._stream, name)


def outlive_broken_streams() -> None:
  """sys.stdout and sys.stderr replaced by streams whose failed writes are dropped (idempotent)."""
  for name in ("stdout", "stderr"):
    stream = getattr(sys, name)
    if stream is not None and not isinstance(stream, _Outlived):
      setattr(sys, name, _Outlived(stream))
