"""What a checkpoint holds: steps, parameter shapes/dtypes/bytes, saved config, from metadata only.

Usage:   python MaxLite/checkpoint_info.py PATH [--step N]     (or: maxlite-checkpoint-info ...)
Example: python MaxLite/checkpoint_info.py outputs/my_run --step 200

PATH may be a run directory, its checkpoints/ directory or one step directory.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from MaxLite import cli


def run(argv: Sequence[str]) -> None:
  parser = cli.FlagParser(__doc__)
  parser.add_argument("path", help="run directory, its checkpoints/ directory or a step directory")
  parser.add_argument("--step", type=int, default=None, help="default: the latest complete step")
  args = parser.parse_args(argv)
  from MaxLite.checkpoint.info import describe  # after the flags: --help and a bad flag answer without orbax

  print(describe(args.path, args.step))


def main(argv: Sequence[str] | None = None) -> int:
  return cli.run(run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())
