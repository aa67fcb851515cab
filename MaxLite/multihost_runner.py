"""MaxText's multihost_runner.py for MaxLite: one command on every worker of existing TPU slices (ssh).

Usage: python3 MaxLite/multihost_runner.py --help   (or: maxlite-tpu-runner --help); the flags are MaxText's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from MaxLite import cli
from MaxLite.launch import tpu_runner


def main(argv: Sequence[str] | None = None) -> int:
  return cli.run(tpu_runner.run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())
