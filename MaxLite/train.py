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

from MaxLite import cli  # noqa: E402
from MaxLite.config import schema  # noqa: E402
from MaxLite.training.start import run, summarize  # noqa: E402

__all__ = ["main", "run", "script", "summarize"]


def main() -> None:
  """Train with the command line in sys.argv; safe to call from another program (it never replaces the process)."""
  cli.run_config_tool(run, __doc__, keys=schema)


def script() -> None:
  """The `maxlite-train` console script: the process is its own, so it may re-exec under tcmalloc first."""
  allocator.reexec_with_tcmalloc()
  main()


if __name__ == "__main__":
  main()
