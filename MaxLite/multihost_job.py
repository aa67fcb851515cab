"""MaxText's multihost_job.py for MaxLite: a job on new TPU slices through a queued resource.

Usage: python3 MaxLite/multihost_job.py --help   (or: maxlite-tpu-job --help); the flags are MaxText's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from MaxLite import cli
from MaxLite.launch import tpu_job


def main(argv: Sequence[str] | None = None) -> int:
  return cli.run(tpu_job.run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())
