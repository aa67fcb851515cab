"""Says that a long, silent piece of work is under way, and for how long: XLA compiles print nothing for tens of
seconds on a laptop and minutes for a large model, which reads as a hang.

  with ticker.ticking("compiling the train step"):
    compiled = lowered.compile()

prints "compiling the train step ..." at once, "... still compiling the train step (30 s)" every `every` seconds
while it lasts, and "compiling the train step: 41.2 s" when it ends (on stderr, so stdout keeps only results).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO


@contextlib.contextmanager
def ticking(what: str, every: float = 15.0, out: TextIO | None = None, enabled: bool = True) -> Iterator[None]:
  stream = out or sys.stderr
  if not enabled:
    yield
    return
  start, done = time.monotonic(), threading.Event()
  print(f"{what} ...", file=stream, flush=True)

  def tick() -> None:
    while not done.wait(every):
      print(f"... still {what} ({time.monotonic() - start:.0f} s)", file=stream, flush=True)

  thread = threading.Thread(target=tick, name="ticker", daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()
    thread.join()
  print(f"{what}: {time.monotonic() - start:.1f} s", file=stream, flush=True)
