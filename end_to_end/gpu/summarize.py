"""Summary table of end_to_end/gpu/bench_vs_maxtext.sh: seconds per step and tokens/s of MaxText and MaxLite per row.

  python end_to_end/gpu/summarize.py OUT_DIR ROW=TOKENS_PER_STEP [...]

Reads OUT_DIR/<row>-maxtext.log (MaxText's "completed step: N, seconds: S, ..." lines: the median over steps 5..end,
less the traced step 5 and the two after it, whose times the profiler's start/stop and block_until_ready distort, and
less the last step, whose time is only its dispatch: MaxText times steps from one dispatch to the next),
OUT_DIR/<row>-maxlite.log (the JSON line of end_to_end/benchmark.py: its median over steps 4..end), OUT_DIR/runs.tsv
(exit codes) and the traces under OUT_DIR/profiles/. Writes OUT_DIR/summary.txt and OUT_DIR/summary.json. Stdlib only.
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys

FIRST_STEP = 5  # MaxText's first timed step (0-based); skip_first_n_steps_for_profiler
PROFILED = {5, 6, 7}  # the traced step and the two after it
STEP_LINE = re.compile(
  r"completed step: (\d+), seconds: ([0-9.]+)(?:, TFLOP/s/device: ([0-9.]+), Tokens/s/device: ([0-9.]+))?"
)


def read(path: str) -> str:
  try:
    with open(path, errors="replace") as f:
      return f.read()
  except OSError:
    return ""


def last_error(text: str) -> str:
  lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
  for ln in reversed(lines):
    if re.search(r"Error|error:|Exception|Killed|Terminated|OOM|RESOURCE_EXHAUSTED", ln):
      return ln[:200]
  return lines[-1][:200] if lines else "(empty log)"


def maxtext(out: str, row: str, tokens: int) -> dict:
  text = read(os.path.join(out, f"{row}-maxtext.log"))
  steps = {}
  for m in STEP_LINE.finditer(text):
    steps[int(m.group(1))] = (float(m.group(2)), m.group(3) and float(m.group(3)))
  last = max(steps, default=-1)
  timed = [s for s in sorted(steps) if s >= FIRST_STEP and s not in PROFILED and s != last]
  if not timed:  # a short run: keep the traced steps rather than nothing
    timed = [s for s in sorted(steps) if s >= FIRST_STEP and s != last] or sorted(steps)[1:]
  if not timed:
    return {"error": last_error(text)}
  step_s = statistics.median(steps[s][0] for s in timed)
  tflops = [steps[s][1] for s in timed if steps[s][1]]
  return {
    "median_step_s": round(step_s, 4),
    "tokens_per_s": round(tokens / step_s, 1),
    "tflops_per_device": round(statistics.median(tflops), 2) if tflops else None,
    # MaxText times dispatch to dispatch: the mean is a cross-check of the median (steady state: the two agree).
    "mean_step_s": round(statistics.fmean(steps[s][0] for s in timed), 4),
    "steps_timed": len(timed),
    "steps_logged": len(steps),
  }


def maxlite(out: str, row: str) -> dict:
  text = read(os.path.join(out, f"{row}-maxlite.log"))
  for ln in reversed(text.splitlines()):
    ln = ln.strip()
    if ln.startswith("{") and "median_step_s" in ln:
      try:
        r = json.loads(ln)
      except json.JSONDecodeError:
        continue
      return {
        "median_step_s": r["median_step_s"],
        "tokens_per_s": r["tokens_per_s"],
        "tflops_per_device": round(r["tflops_per_device"], 2),
        "steps_timed": r["steps_timed"],
        "first_step_s": r.get("first_step_s"),
        "launch_to_first_step_s": r.get("launch_to_first_step_s"),
      }
  return {"error": last_error(text)}


def rcs(out: str) -> dict[str, str]:
  rows = [ln.split("\t") for ln in read(os.path.join(out, "runs.tsv")).splitlines()[1:] if ln]
  return {r[0]: f"{r[1]} ({r[2]}s)" for r in rows if len(r) >= 3}


def traces(out: str, run_name: str) -> list[str]:
  pattern = os.path.join(out, "profiles", run_name, "**", "*.xplane.pb")
  return sorted(os.path.relpath(p, out) for p in glob.glob(pattern, recursive=True))


def main(argv: list[str]) -> None:
  if len(argv) < 2:
    raise SystemExit(__doc__)
  out = argv[0]
  rows = [(a.split("=")[0], int(a.split("=")[1])) for a in argv[1:]]
  ran = rcs(out)
  result = {}
  header = f"{'row':<22} {'system':<8} {'s/step':>9} {'tokens/s':>11} {'TFLOP/s/dev*':>12} {'timed':>5}"
  header += "  rc (s)      trace"
  lines = [header, "-" * len(header)]
  for row, tokens in rows:
    # A variant row (llama3.2-1b-noremat) is MaxLite alone: it is set beside its base row's MaxText run.
    bases = [r for r, _ in rows if row.startswith(r + "-")]
    has_own = os.path.exists(os.path.join(out, f"{row}-maxtext.log"))
    base = max(bases, key=len) if bases and not has_own else row
    result[row] = {
      "tokens_per_step": tokens,
      "maxtext": maxtext(out, base, tokens)
      | {"rc": ran.get(f"{base}-maxtext"), "traces": traces(out, f"{base}-maxtext"), "row": base},
      "maxlite": maxlite(out, row)
      | {
        "rc": ran.get(f"{row}-maxlite"),
        "traces": traces(out, f"{row}-maxlite"),
      },
    }
    for system in ("maxtext", "maxlite"):
      if system == "maxtext" and base != row:
        lines.append(f"{row:<22} (MaxText: the {base} row above)")
        continue
      r = result[row][system]
      trace = f"{len(r['traces'])} xplane.pb" if r["traces"] else "none"
      if "error" in r:
        lines.append(f"{row:<22} {system:<8} {'FAILED':>9} {'':>11} {'':>12} {'':>5}  {r['rc']!s:<11} {trace}")
        lines.append(f"{'':<22}   {r['error']}")
      else:
        tf = "" if r["tflops_per_device"] is None else f"{r['tflops_per_device']:.2f}"
        lines.append(
          f"{row:<22} {system:<8} {r['median_step_s']:>9.4f} {r['tokens_per_s']:>11.1f} {tf:>12} "
          f"{r['steps_timed']:>5}  {r['rc']!s:<11} {trace}"
        )
    mt, ml = result[row]["maxtext"], result[row]["maxlite"]
    if "error" not in mt and "error" not in ml:
      ratio = ml["tokens_per_s"] / mt["tokens_per_s"]
      result[row]["maxlite_over_maxtext_tokens_per_s"] = round(ratio, 3)
      lines.append(f"{'':<22} MaxLite/MaxText tokens/s = {ratio:.3f}")
    if "error" not in mt and abs(mt["mean_step_s"] / mt["median_step_s"] - 1) > 0.1:
      lines.append(f"{'':<22} note: MaxText's mean step {mt['mean_step_s']:.4f} s is >10% off its median")
  lines.append("* each system's own model-FLOP count (MaxText's and MaxLite's formulas differ in detail)")
  text = "\n".join(lines)
  print(text)
  with open(os.path.join(out, "summary.txt"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
