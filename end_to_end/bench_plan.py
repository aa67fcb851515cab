"""plan.py against MaxText's published MFU table (its v5p and v5e high-performance recipes): prints the README table.

  python end_to_end/bench_plan.py [--budget_s 300] [--rows v5p-32b,v5e-16b,...] [--workers 2]

For each row: (a) the prediction for MaxText's own recipe (configs/tpu/<chip>/<size>.yml: the keys of MaxText's
configs/<chip>/<size>.sh in MaxLite's names, its published MFU in a `# published_mfu:` line), and (b) plan.py's
own pick on the same slice and sequence length within --budget_s. Results come from plan.py's cache when it has
them. plan.py counts model FLOPs with causal attention at half; MaxText's published figures (its 2024
maxtext_utils.calculate_tflops_training_per_device) count attention without the causal mask, so each prediction
is also given on MaxText's count, the one compared with the published figure.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import time
import types

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(REPO, "configs", "tpu")


def _value(v: object) -> str:
  return str(v).lower() if isinstance(v, bool) else str(v)


def recipe_rows() -> dict[str, tuple[str, str, list[str], float]]:
  """row name (v5p-32b, ...) -> (slice, model, the recipe's other keys, published MFU %), from configs/tpu/<chip>/."""
  rows = {}
  for path in sorted(glob.glob(os.path.join(RECIPES, "*", "*.yml"))):
    with open(path) as f:
      text = f.read()
    data = yaml.safe_load(text)
    published = float(re.search(r"^# published_mfu: ([\d.]+)", text, re.M).group(1))
    keys = [f"{k}={_value(v)}" for k, v in data.items() if k not in ("base_config", "model_name", "compile_topology")]
    chip, size = path.split(os.sep)[-2], os.path.basename(path)[: -len(".yml")]
    rows[f"{chip}-{size}"] = (data["compile_topology"], data["model_name"], keys, published)
  return rows


def maxtext_count(model: str, seq: int) -> float:
  """MaxText's FLOPs per step over MaxLite's for a model and sequence length: MaxText's 2024 count has the full,
  unmasked attention score matmuls, MaxLite's (training/flops.py) half of them. The same for every batch and layout."""
  if REPO not in sys.path:
    sys.path.insert(0, REPO)
  from MaxLite.config import loader
  from MaxLite.models import flops

  raw = loader.load_raw([os.path.join(REPO, "configs", "base.yml"), f"model_name={model}"])
  counted = flops.training_flops_per_step(
    types.SimpleNamespace(**{**raw, "global_batch_size_to_train_on": 1, "max_target_length": seq})
  )
  return (counted["total"] + counted["attention"]) / counted["total"]


def plan(yml: str, args: list[str], budget: float, workers: int) -> tuple[str, float]:
  command = [sys.executable, "MaxLite/plan.py", yml, *args, f"plan_time_budget_s={budget}"]
  command += [f"plan_workers={workers}", "plan_top_n=3", "--plan_output=/dev/null"]
  started = time.time()
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
  errors = "".join(line + "\n" for line in done.stderr.splitlines() if line.startswith("error:"))
  return done.stdout + errors, time.time() - started


def rows_of(stdout: str) -> list[tuple[str, float, bool]]:
  """(plan, predicted MFU %, is the config as given) of each ranked row."""
  found = re.findall(r"^\s*\d+\s{2}(.+?)\s+(\d+\.\d)%", stdout, re.M)
  return [(p.removesuffix(" *").strip(), float(m), p.endswith(" *")) for p, m in found]


def recipe_file(keys: list[str], batch: float) -> str:
  """MaxText's recipe as a config file: its keys are the baseline plan.py compiles first, not pins."""
  path = os.path.join(tempfile.mkdtemp(prefix="maxtext_recipe_"), "recipe.yml")
  lines = [f"base_config: {os.path.join(REPO, 'configs', 'base.yml')}"]
  lines += [k.replace("=", ": ", 1) for k in keys if not k.startswith("per_device_batch_size")]
  lines += [
    f"per_device_batch_size: {batch:g}",
    "ici_fsdp_parallelism: -1" if not any("fsdp" in k for k in keys) else "",
  ]
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  return path


def _mfu(row: tuple[str, float, bool] | None, ratio: float, published: float) -> str:
  """MaxLite's count, then MaxText's and its distance from the published figure."""
  return f"{row[1]:.1f}% ({row[1] * ratio:.1f}%, {row[1] * ratio - published:+.1f})" if row else "-"


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--budget_s", type=float, default=300)
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--rows", default=",".join(recipe_rows()))
  args = p.parse_args()
  lines = [
    "| row | slice | published MFU | recipe batch | predicted for the recipe (MaxText's count) | plan.py's pick | "
    "predicted (MaxText's count) | seconds |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for name in args.rows.split(","):
    topology, model, recipe, published = recipe_rows()[name]
    batch = float(next(k for k in recipe if k.startswith("per_device_batch_size")).split("=")[1])
    seconds, note, where = 0.0, "", [f"model_name={model}", f"compile_topology={topology}"]
    while True:  # the recipe as one pinned plan: its batch, else the largest smaller one that fits MaxLite
      pins = [*[k for k in recipe if not k.startswith("per_device")], f"per_device_batch_size={batch:g}"]
      pins += [] if any("fsdp" in k for k in recipe) else ["ici_fsdp_parallelism=-1"]
      pins += [] if any("tensor" in k for k in recipe) else ["ici_tensor_parallelism=1"]
      pins += ["ici_data_parallelism=1", "ici_sequence_parallelism=1", "ici_pipeline_parallelism=1"]
      out, spent = plan(os.path.join(REPO, "configs", "base.yml"), [*where, *pins], args.budget_s, args.workers)
      seconds += spent
      configured = next((r for r in rows_of(out) if r[2]), None)  # the recipe exactly, every key pinned
      if configured or batch <= 1:
        break
      note = note or f"{batch:g} does not fit MaxLite; "
      batch -= 1
    out, spent = plan(recipe_file(recipe, batch), where, args.budget_s, args.workers)  # the search, recipe first
    seconds += spent
    rows = rows_of(out)
    best = rows[0] if rows else None
    seq = int(next(k for k in recipe if k.startswith("max_target_length")).split("=")[1])
    ratio = maxtext_count(model, seq)

    lines.append(
      f"| {name} | {topology} | {published:.1f}% | {note}{batch:g} | "
      f"{_mfu(configured, ratio, published) if configured else 'does not fit'} | {best[0] if best else 'none'} | "
      f"{_mfu(best, ratio, published)} | {seconds:.0f} |"
    )
    print(lines[-1], flush=True)
    if not rows:
      print(out[-3000:], file=sys.stderr)
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
