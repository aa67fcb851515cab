r"""Compile the real train step ahead of time for a TPU topology (or cpu-N) and say whether it fits.

Usage:   python MaxLite/train_compile.py CONFIG.yml compile_topology=TOPOLOGY [key=value ...]
         (or: maxlite-compile ...)
Example: python MaxLite/train_compile.py configs/base.yml compile_topology=v5p-128 model_name=llama2-7b \
           per_device_batch_size=4 max_target_length=4096 dtype=bfloat16 ici_fsdp_parallelism=-1

Runs on any machine: TPU targets need only the libtpu library (setup.sh puts it in .deps/libtpu),
never a TPU. Prints per-device memory (parameters, optimizer state, and the compiled program's
argument / output / temporary bytes), the chip's HBM and whether the step fits, MaxLite's model-FLOPs
formula (with XLA's compiled count beside it where the program has no loop: XLA counts a loop's body,
e.g. the scanned layers, once), and a roofline step time. Exit code 0 = fits,
3 = does not fit (the shortfall is printed), 2 = bad input. The result also goes into plan.py's cache
(plan_cache_dir): a plan search on the same keys starts from it instead of compiling the config again.
"""

from collections.abc import Sequence

from MaxLite import cli
from MaxLite.aot import compile_step
from MaxLite.aot.compile_step import DOES_NOT_FIT
from MaxLite.config import schema

__all__ = ["DOES_NOT_FIT", "main", "run"]


def run(argv: Sequence[str]) -> int:
  """Compile, report, and keep the result where plan.py looks first (its cache: the same keys compile once)."""
  from MaxLite.planning import search

  return compile_step.run(argv, after_compile=search.remember_compile)


def main() -> None:
  cli.run_config_tool(run, __doc__, keys=schema)


if __name__ == "__main__":
  main()
