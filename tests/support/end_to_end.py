"""end_to_end/'s helper modules for the files under tests/: procs (train.py and launch_local.py as real processes, their
logs and metrics), gcs (a local stand-in for a bucket) and bench_plan. Their folder goes on sys.path here, once; the
files in end_to_end/ import them directly (pytest puts a test file's own folder on sys.path)."""

import os
import sys

from support.config import REPO

END_TO_END = os.path.join(REPO, "end_to_end")
if END_TO_END not in sys.path:
  sys.path.insert(0, END_TO_END)

import bench_plan  # noqa: E402
import procs  # noqa: E402
from gcs import LocalGCS  # noqa: E402

__all__ = ["END_TO_END", "LocalGCS", "bench_plan", "procs"]
