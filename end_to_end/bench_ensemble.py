"""A seed sweep two ways, as one JSON line: K members in one program (benchmark.py with ensemble_size=K on K simulated
CPU devices) against K separate runs of the same model one after another (benchmark.py with init_weights_seed=i
seed=i, one process each), wall time of each from launch to exit and their ratio.

  python end_to_end/bench_ensemble.py [configs/bench.yml] [members=8] [key=value ...]

Both sides train the same steps on the same machine; each separate run pays its own start-up and compilation, which is
what running a sweep as separate jobs costs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from MaxLite.launch.local import process_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARK = os.path.join(REPO, "end_to_end", "benchmark.py")


def _timed(args: list[str], devices: int) -> tuple[float, dict]:
  """(wall seconds, benchmark.py's JSON line) of one benchmark.py process on `devices` CPU devices."""
  start = time.perf_counter()
  proc = subprocess.run(
    [sys.executable, BENCHMARK, *args], capture_output=True, text=True, env=process_env(devices), cwd=REPO
  )
  wall = time.perf_counter() - start
  if proc.returncode != 0:
    raise SystemExit(f"error: benchmark.py {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
  return wall, json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def main(argv: list[str]) -> None:
  config = [a for a in argv if "=" not in a][:1] or [os.path.join(REPO, "configs", "bench.yml")]
  members = int(next((a.split("=", 1)[1] for a in argv if a.startswith("members=")), 8))
  overrides = [a for a in argv if "=" in a and not a.startswith("members=")]
  together_s, together = _timed(
    [*config, *overrides, f"ensemble_size={members}", f"ici_ensemble_parallelism={members}"], members
  )
  separate = [_timed([*config, *overrides, f"init_weights_seed={i}", f"seed={i}"], 1) for i in range(members)]
  sequence_s = sum(wall for wall, _ in separate)
  mean = lambda key: sum(r[key] for _, r in separate) / members  # noqa: E731
  print(
    json.dumps(
      {
        "members": members,
        "overrides": overrides,
        "one_program_wall_s": round(together_s, 2),
        "separate_runs_wall_s": round(sequence_s, 2),
        "wall_time_ratio": round(sequence_s / together_s, 3),  # > 1: the one program is faster
        "one_program_tokens_per_s": together["tokens_per_s"],
        "separate_run_tokens_per_s": round(mean("tokens_per_s"), 1),
        "one_program_launch_to_first_step_s": together["launch_to_first_step_s"],
        "separate_run_launch_to_first_step_s": round(mean("launch_to_first_step_s"), 2),
      }
    ),
    flush=True,
  )


if __name__ == "__main__":
  main(sys.argv[1:])
