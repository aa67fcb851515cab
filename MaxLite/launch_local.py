r"""Run N train.py processes on this machine, joined by jax.distributed, as a multi-host job would.

Usage:   python MaxLite/launch_local.py [--num_processes=N] [--devices_per_process=M] [--show_all_processes]
           CONFIG.yml [key=value ...]      (or: maxlite-launch-local ...)
Example: python MaxLite/launch_local.py --num_processes=2 --devices_per_process=4 configs/base.yml \
           ici_fsdp_parallelism=8 steps=20

Each process simulates M CPU devices. Logs go to <run_dir>/logs/process_<i>.log; process 0's also to this terminal,
prefixed [p0] (every process's with --show_all_processes). If any process fails the others are stopped, its last
lines are printed, and the exit code is the worst.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from MaxLite import cli
from MaxLite.launch import local


def main(argv: Sequence[str] | None = None) -> int:
  return cli.run(lambda args: local.run(args, __doc__), sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())
