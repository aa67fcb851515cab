"""Run the process under tcmalloc when the system has it: a re-exec with LD_PRELOAD, before jax is imported.

XLA's host runtime allocates and frees its large buffers (the [tokens, vocab] logits, gradients) on every step.
glibc hands buffers that large back to the kernel on free, so each step pays page faults to touch fresh pages
again; tcmalloc keeps them. Measured on the 2-core CPU benchmark (end_to_end/benchmark.py, configs/bench.yml):
0.537 -> 0.465 s per step in float32, 0.632 -> 0.55 s in bfloat16. MAXLITE_TCMALLOC=0 turns this off.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence

# Where Debian/Ubuntu (libtcmalloc-minimal4, google-perftools) and Red Hat-family packages put it.
CANDIDATES = (
  "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
  "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
  "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
  "/usr/lib/aarch64-linux-gnu/libtcmalloc.so.4",
  "/usr/lib64/libtcmalloc_minimal.so.4",
  "/usr/lib64/libtcmalloc.so.4",
)


def tcmalloc_path(candidates: Sequence[str] = CANDIDATES) -> str | None:
  return next((p for p in candidates if os.path.isfile(p)), None)


# A preloaded library whose name says it is an allocator (jemalloc, tcmalloc, mimalloc, snmalloc, Hoard ...):
# the user chose it, and preloading tcmalloc in front of it would silently replace it.
_ALLOCATOR = re.compile(r"malloc|hoard", re.IGNORECASE)


def preload_env(env: Mapping[str, str], library: str | None) -> dict[str, str] | None:
  """The environment to re-exec with, or None when nothing should change (turned off, none installed, tcmalloc
  or another allocator already preloaded)."""
  if library is None or env.get("MAXLITE_TCMALLOC", "1") == "0" or _ALLOCATOR.search(env.get("LD_PRELOAD", "")):
    return None
  preload = " ".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
  # tcmalloc reports every allocation over 1 GiB on stderr by default; a model's buffers are routinely larger.
  return {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(2**40), **env, "LD_PRELOAD": preload}


def reexec_with_tcmalloc() -> None:
  """Replace this process (same pid, same interpreter options and arguments: a script, -m or -c run alike) with
  one that has tcmalloc preloaded; a no-op otherwise. Call it only from a script's entry (`__main__`, a console
  script), first thing: nothing done before it survives, and a program that calls a library function must never
  be replaced by it."""
  if sys.platform != "linux":
    return
  env = preload_env(os.environ, tcmalloc_path())
  if env is not None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
