"""Train a Llama-family model.

Usage:   python MaxLite/train.py CONFIG.yml [key=value ...]     (or: maxlite-train CONFIG.yml ...)
Example: python MaxLite/train.py configs/base.yml model_name=tiny steps=50 ici_fsdp_parallelism=-1

Every key of configs/base.yml can be set as key=value. The run writes <base_output_directory>/<run_name>/
(metrics.jsonl, tensorboard/, checkpoints/) and resumes from its newest checkpoint when started again.
"""

from __future__ import annotations

from MaxLite.runtime import allocator

if __name__ == "__main__":
  allocator.reexec_with_tcmalloc()  # before jax is imported (the console script re-execs in script())

from collections.abc import Sequence  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from MaxLite import cli  # noqa: E402
from MaxLite.config import schema  # noqa: E402

if TYPE_CHECKING:
  from MaxLite.training.start import run, summarize

__all__ = ["main", "run", "script", "summarize"]


def __getattr__(name: str) -> Any:
  # run and summarize are training.start's: imported when first read, so --help, --describe and a usage error
  # answer without starting jax and flax (0.2 s instead of 1.1).
  if name in ("run", "summarize"):
    from MaxLite.training import start

    return getattr(start, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _run(argv: Sequence[str]) -> int | None:
  from MaxLite.training.start import run

  return run(argv)


def main() -> None:
  """Train with the command line in sys.argv; safe to call from another program (it never replaces the process)."""
  cli.run_config_tool(_run, __doc__, keys=schema)


def script() -> None:
  """The `maxlite-train` console script: the process is its own, so it may re-exec under tcmalloc first."""
  allocator.reexec_with_tcmalloc()
  main()


if __name__ == "__main__":
  main()
