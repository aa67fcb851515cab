"""benchmark.py prints its JSON line with consistent numbers; profiler=xplane writes a trace tensorboard reads."""

import glob
import json
import os
import subprocess
import sys

import procs

BENCH = os.path.join(procs.REPO, "end_to_end", "benchmark.py")


def test_benchmark_prints_one_consistent_json_line():
  proc = subprocess.run(
    [
      sys.executable,
      BENCH,
      os.path.join(procs.REPO, "configs", "bench.yml"),
      "model_name=tiny",
      "steps=6",
      "max_target_length=64",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env=procs.env_with_devices(1),
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
  assert len(lines) == 1, proc.stdout
  result = json.loads(lines[0])
  assert result["tokens_per_step"] == 4 * 64 and result["steps_timed"] == 3
  assert result["tokens_per_s"] > 0 and result["matmul_peak_tflops"] > 0 and result["peak_rss_mib"] > 100
  assert abs(result["tokens_per_s"] * result["median_step_s"] - 256) < 1.0
  assert abs(result["mfu_vs_matmul_peak"] - result["tflops_per_device"] / result["matmul_peak_tflops"]) < 1e-3
  assert 0 < result["first_step_s"] <= result["launch_to_first_step_s"]


def test_profiler_writes_an_xplane_trace_for_the_chosen_steps(tmp_path):
  log = str(tmp_path / "log.txt")
  code = procs.run(
    procs.train_command(
      "model_name=tiny",
      "dataset_type=synthetic",
      "max_target_length=64",
      "steps=5",
      "profiler=xplane",
      "skip_first_n_steps_for_profiler=2",
      "profiler_steps=2",
      f"base_output_directory={tmp_path}",
      "run_name=p",
    ),
    log,
  )
  assert code == 0, procs.tail(log)
  traces = glob.glob(str(tmp_path / "p" / "tensorboard" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 1000, traces
  # The trace covers the train step program.
  with open(traces[0], "rb") as f:
    assert b"train_step" in f.read()
