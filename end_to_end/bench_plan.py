"""plan.py against MaxText's published MFU table (its v5p and v5e high-performance recipes): prints the README table.

  python end_to_end/bench_plan.py [--budget_s 300] [--rows v5p-32b,v5e-16b,...] [--workers 2]

For each row: (a) the prediction for MaxText's own recipe (the keys of its configs/tpu/<chip>/<size>.sh translated
to MaxLite's: the same model shape, slice, per-device batch, remat policy, mesh, flash attention, bf16 activations
and float32 weights), and (b) plan.py's own pick on the same slice and sequence length within --budget_s. Results
come from plan.py's cache when it has them. Both use MaxLite's model FLOPs (causal attention counted at half).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# row: (slice, model, recipe keys, published MFU %) from MaxText's configs/tpu/v5p/README.md and v5e/README.md.
COMMON = ["max_target_length=2048", "dtype=bfloat16", "weight_dtype=float32", "attention=splash"]
MINIMAL, FULL = "remat_policy=minimal", "remat_policy=full"
ROWS = {
  "v5p-32b": ("v5p-128", "maxtext-32b", ["per_device_batch_size=6", MINIMAL, "ici_tensor_parallelism=4"], 71.47),
  "v5p-64b": ("v5p-128", "maxtext-64b", ["per_device_batch_size=3", MINIMAL, "ici_tensor_parallelism=4"], 70.31),
  "v5p-128b": ("v5p-256", "maxtext-128b", ["per_device_batch_size=1", MINIMAL, "ici_tensor_parallelism=8"], 68.68),
  "v5e-16b": ("v5e-256", "maxtext-16b", ["per_device_batch_size=6", FULL], 61.10),
  "v5e-32b": ("v5e-256", "maxtext-32b", ["per_device_batch_size=4", FULL], 66.86),
  "v5e-64b": ("v5e-256", "maxtext-64b", ["per_device_batch_size=2", FULL], 59.90),
  "v5e-128b": (
    "v5e-256",
    "maxtext-128b",
    ["per_device_batch_size=1", "remat_policy=qkv_proj_offloaded"]
    + ["ici_fsdp_parallelism=16", "ici_tensor_parallelism=16"],
    56.06,
  ),
}
_PIN_ALL = ["ici_data_parallelism=1", "ici_sequence_parallelism=1", "ici_pipeline_parallelism=1"]


def plan(args: list[str], budget: float, workers: int) -> tuple[str, float]:
  command = [sys.executable, "MaxLite/plan.py", "configs/base.yml", *args, f"plan_time_budget_s={budget}"]
  command += [f"plan_workers={workers}", "plan_top_n=3", "--plan_output=/dev/null"]
  started = time.time()
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
  if done.returncode not in (0, 2):
    sys.stderr.write(done.stderr[-3000:])
  return done.stdout + "".join(line + "\n" for line in done.stderr.splitlines() if line.startswith("error:")), (
    time.time() - started
  )


def best_row(stdout: str) -> tuple[str, float] | None:
  import re

  found = re.search(r"^\s*1\s{2}(.+?)\s+(\d+\.\d)%", stdout, re.M)
  return (found.group(1).strip(), float(found.group(2))) if found else None


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--budget_s", type=float, default=300)
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--rows", default=",".join(ROWS))
  args = p.parse_args()
  lines = [
    "| row | slice | published MFU | predicted, MaxText's recipe | predicted, plan.py's pick | pick fits | seconds |",
    "|---|---|---|---|---|---|---|",
  ]
  for name in args.rows.split(","):
    topology, model, recipe, published = ROWS[name]
    base = [f"model_name={model}", f"compile_topology={topology}", *COMMON]
    pinned = recipe + [k for k in _PIN_ALL if k.split("=")[0] not in " ".join(recipe)]
    if not any(k.startswith("ici_fsdp") for k in recipe):
      pinned.append("ici_fsdp_parallelism=-1")
    recipe_out, recipe_s = plan([*base, *pinned, "plan_top_n=1"], args.budget_s, args.workers)
    pick_out, pick_s = plan(base, args.budget_s, args.workers)
    recipe_best, pick_best = best_row(recipe_out), best_row(pick_out)
    recipe_text = f"{recipe_best[1]:.1f}%" if recipe_best else "did not fit / failed"
    pick_text = f"{pick_best[1]:.1f}% ({pick_best[0]})" if pick_best else "none"
    lines.append(
      f"| {name} | {topology} | {published:.1f}% | {recipe_text} | {pick_text} | {'yes' if pick_best else 'no'} | "
      f"{recipe_s + pick_s:.0f} |"
    )
    print(lines[-1], flush=True)
    if not recipe_best:
      print(recipe_out[-2000:], file=sys.stderr)
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
